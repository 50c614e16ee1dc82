#!/usr/bin/env python3
"""Write the benchmark request bodies into payloads/ (deterministic for a given seed and Python).

small.json       system + 2 turns, ~100 tokens
agent_long.json  coding-agent conversation, ~60 user turns, tool_calls + role=tool results, ~60k tokens
agent_huge.json  same shape, ~400k tokens (does not fit a 128k window); 1.6 MB, so it is kept
                 gzip-compressed as agent_huge.json.gz: read_payload() and payload_file() decompress it

Tool outputs are real text from this Python's standard library sources, so the
content is varied; a different Python version gives different (but same-sized) text.
Token counts are cl100k_base over message contents plus tool-call names/arguments.
"""
import argparse
import ast
import gzip
import json
import os
import random
import string
import sys
import sysconfig
from importlib.util import find_spec

HERE = os.path.dirname(os.path.abspath(__file__))
PAYLOADS = os.path.join(HERE, "payloads")
COMPRESSED = {"agent_huge.json"}  # stored as <name>.gz (gzip -9, mtime 0): the same bytes once decompressed


def read_payload(name, folder=PAYLOADS):
    """The bytes of payloads/<name>; one kept as <name>.gz is decompressed in memory."""
    path = os.path.join(folder, name)
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        with gzip.open(path + ".gz", "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def payload_file(name, scratch, folder=PAYLOADS):
    """A file wrk can read: payloads/<name> itself, or its .gz decompressed once into `scratch`."""
    path = os.path.join(folder, name)
    if os.path.exists(path) or not os.path.exists(path + ".gz"):
        return path
    out = os.path.join(scratch, name)
    if not os.path.exists(out):
        os.makedirs(scratch, exist_ok=True)
        with open(out + ".tmp", "wb") as f:
            f.write(read_payload(name, folder))
        os.replace(out + ".tmp", out)
    return out


def encoding(name="cl100k_base"):
    """tiktoken encoding, offline: reuse the tokenizer files LiteLLM ships if no cache is set."""
    if "TIKTOKEN_CACHE_DIR" not in os.environ:
        spec = find_spec("litellm")
        if spec and spec.submodule_search_locations:
            d = os.path.join(list(spec.submodule_search_locations)[0], "litellm_core_utils", "tokenizers")
            if os.path.isdir(d):
                os.environ["TIKTOKEN_CACHE_DIR"] = d
    import tiktoken
    return tiktoken.get_encoding(name)


def count_tokens(messages, enc):
    n = 0
    for m in messages:
        if isinstance(m.get("content"), str):
            n += len(enc.encode(m["content"], disallowed_special=()))
        for tc in m.get("tool_calls") or []:
            n += len(enc.encode(tc["function"]["name"] + tc["function"]["arguments"], disallowed_special=()))
    return n


SYSTEM = """You are an autonomous coding agent working inside a user's repository.
You can call tools to read files, search the code, edit files and run shell commands.
Rules:
- Read the relevant code before proposing a change; never guess at file contents.
- Prefer small, reviewable edits. Keep the existing style, naming and error handling.
- When a command fails, read the error, form a hypothesis, and test it with one more command.
- Never run destructive commands (rm -rf, git push --force, dropping tables) without asking.
- Explain what you found in plain language, citing file paths and line numbers.
- If a request is ambiguous, state your assumption and continue.
- Keep answers short: findings first, then the proposed change, then how you verified it.
The repository is a large Python code base. Tests run with `python -m pytest -q`.
Available tools: read_file(path, start_line, end_line), grep(pattern, path),
run_shell(command, timeout_s), edit_file(path, old, new)."""

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read lines of a text file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "start_line": {"type": "integer"},
                    "end_line": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "grep", "description": "Search files for a regular expression.",
     "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                    "required": ["pattern"]}}},
    {"type": "function", "function": {"name": "run_shell", "description": "Run a shell command and return its output.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout_s": {"type": "integer"}},
                    "required": ["command"]}}},
    {"type": "function", "function": {"name": "edit_file", "description": "Replace one exact snippet in a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                    "new": {"type": "string"}}, "required": ["path", "old", "new"]}}},
]

QUESTIONS = [
    "Can you look at `{path}` and explain what `{name}` does?",
    "There's a bug report saying `{name}` misbehaves on empty input. Check `{path}` and tell me if that's plausible.",
    "Find where `{name}` is used and tell me whether changing its signature is safe.",
    "Run the tests around `{mod}` and summarize anything that fails.",
    "I want to refactor `{name}` in `{path}`; what does it depend on? Plan first, no edits yet.",
    "Why would `{name}` be slow on large inputs? Look at `{path}`.",
    "Add a short docstring to `{name}` in `{path}` if it lacks one, matching the module's style.",
    "Does `{mod}` handle errors consistently? Compare `{name}` with the rest of `{path}`.",
    "What changed semantics-wise if I replace the loop in `{name}` with a comprehension?",
    "Check whether `{name}` in `{path}` is thread-safe.",
]
OPENERS = ["Here's what I found.", "Short answer:", "Findings:", "I read the code; summary below.",
           "Looked at it.", "Done reading."]


class Corpus:
    def __init__(self, rng):
        root = sysconfig.get_paths()["stdlib"]
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
            files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
        self.root, self.files, self.rng = root, files, rng

    def pick(self):
        while True:
            path = self.rng.choice(self.files)
            try:
                text = open(path, encoding="utf-8").read()
                tree = ast.parse(text)
            except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
                continue
            funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if len(text) > 4000 and funcs:
                rel = os.path.relpath(path, self.root).replace(os.sep, "/")
                return rel, text.splitlines(), funcs


def call_id(rng):
    return "call_" + "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(24))


def snippet(lines, start, budget, enc, numbered=True):
    """Lines from `start` (wrapping) until about `budget` tokens."""
    out, used, i = [], 0, start
    while used < budget and len(out) < len(lines):
        ln = lines[i % len(lines)]
        s = "%5d  %s" % (i % len(lines) + 1, ln) if numbered else ln
        used += len(enc.encode(s, disallowed_special=())) + 1
        out.append(s)
        i += 1
    return "\n".join(out), i


def agent_turn(rng, corpus, enc, tool_budget, last):
    rel, lines, funcs = corpus.pick()
    fn = rng.choice(funcs)
    name, mod = fn.name, rel[:-3].replace("/", ".")
    msgs = [{"role": "user", "content": rng.choice(QUESTIONS).format(path=rel, name=name, mod=mod)}]
    rounds = 1 if last else rng.choice([1, 1, 2])
    per_call = max(40, tool_budget // rounds)
    for r in range(rounds):
        calls, results = [], []
        kinds = ["read_file"] + (["grep"] if rng.random() < 0.5 else []) + (["run_shell"] if rng.random() < 0.2 else [])
        for kind in kinds:
            cid = call_id(rng)
            share = per_call // len(kinds)
            if kind == "read_file":
                start = max(0, fn.lineno - 1 - rng.randint(0, 20)) if r == 0 else rng.randrange(len(lines))
                text, end = snippet(lines, start, share, enc)
                args = {"path": rel, "start_line": start + 1, "end_line": end}
            elif kind == "grep":
                hits = [("%s:%d: %s" % (rel, j + 1, l.strip())) for j, l in enumerate(lines) if name in l]
                text, _ = snippet(hits or [rel + ": no matches"], 0, share, enc, numbered=False)
                args = {"pattern": r"\b%s\b" % name, "path": os.path.dirname(rel) or "."}
            else:
                cmd = "python -m pytest -q tests/test_%s.py -k %s" % (mod.split(".")[-1], name)
                body, _ = snippet(lines, rng.randrange(len(lines)), share - 30, enc, numbered=False)
                text = ("$ %s\n%s\nFAILED tests/test_%s.py::test_%s - AssertionError\n1 failed, %d passed in %.2fs"
                        % (cmd, body, mod.split(".")[-1], name, rng.randint(3, 80), rng.uniform(0.2, 9)))
                args = {"command": cmd, "timeout_s": 120}
            calls.append({"id": cid, "type": "function",
                          "function": {"name": kind, "arguments": json.dumps(args)}})
            results.append({"role": "tool", "tool_call_id": cid, "content": text})
        content = None if rng.random() < 0.7 else "Let me check %s first." % rel
        msgs.append({"role": "assistant", "content": content, "tool_calls": calls})
        msgs += results
    if not last:
        doc = ast.get_docstring(fn) or "It has no docstring; the behaviour follows from the code."
        msgs.append({"role": "assistant", "content": "%s `%s` in `%s` (line %d): %s\nNo edits made yet."
                     % (rng.choice(OPENERS), name, rel, fn.lineno, " ".join(doc.split()[:80]))})
    return msgs


def agent(rng, enc, target, turns):
    corpus = Corpus(rng)
    msgs = [{"role": "system", "content": SYSTEM}]
    used = count_tokens(msgs, enc)
    for t in range(turns):
        # roughly 150 tokens of a turn are not tool output; the rest fills the per-turn share
        share = (target - used) // (turns - t)
        turn = agent_turn(rng, corpus, enc, max(60, share - 150), last=(t == turns - 1))
        msgs += turn
        used += count_tokens(turn, enc)
    return {"model": "gpt-4o-mini", "messages": msgs, "tools": TOOLS}


def small():
    return {"model": "gpt-4o-mini", "messages": [
        {"role": "system",
         "content": "You are a concise assistant for a software team. Answer in at most three sentences."},
        {"role": "user", "content": "What does HTTP status 429 mean, and what should a client do when it gets one?"},
        {"role": "assistant", "content": "429 means Too Many Requests: the server is rate limiting you. Back off and "
                                         "retry later, honouring the Retry-After header if present."},
        {"role": "user", "content": "And how is that different from a 503 response?"},
    ]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=PAYLOADS)
    a = ap.parse_args()
    enc = encoding()
    os.makedirs(a.out, exist_ok=True)
    specs = [("small.json", lambda: small()),
             ("agent_long.json", lambda: agent(random.Random(a.seed), enc, 60_000, 60)),
             ("agent_huge.json", lambda: agent(random.Random(a.seed + 1), enc, 400_000, 240))]
    for fname, make in specs:
        body = make()
        data = json.dumps(body).encode()
        path = os.path.join(a.out, fname)
        if fname in COMPRESSED:
            path += ".gz"
        with open(path, "wb") as f:
            f.write(gzip.compress(data, 9, mtime=0) if fname in COMPRESSED else data)
        m = body["messages"]
        print("%-16s %4d messages  %3d user  %4d tool  %7d tokens  %8d bytes" % (
            fname, len(m), sum(x["role"] == "user" for x in m), sum(x["role"] == "tool" for x in m),
            count_tokens(m, enc), len(data)), file=sys.stderr)


if __name__ == "__main__":
    main()
