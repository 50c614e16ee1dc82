"""An outside review's differential fuzzer (strict: same types, same key order, same refusal) of KnownBodies.parse
against read_json_body, splicing hostile bytes at the remembered places of the remembered bodies."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson

from proxy.core.errors import CtxProxyError
from proxy.serve.bodies import KnownBodies, read_json_body


def strict(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(strict(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(strict(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def outcome(f: Any) -> Any:
    try:
        return ("ok", f())
    except CtxProxyError as exc:
        return ("refused", exc.status, exc.code, str(exc))


ATOMS = [b",", b"]", b"[", b"{", b"}", b'"', b"\\", b":", b"0", b"1", b"-", b".", b"e", b"null", b" ", b"\n",
         b'"model"', b'"n"', b'"messages"', b"\\u0022", b"\\\\", b'\\"', b"9" * 19, b"\xff", b"\x00", b"true",
         b'{"role":"user","content":"a"}', b'"x"', b"1e400", b"-0", b"\xe2\x82", b"\xe2\x82\xac"]


def hostile(r: random.Random) -> bytes:
    if r.random() < 0.5:  # mostly valid new elements, with odd spellings
        choices: list[Any] = [0, -0.0, 1.5, 10**18, -(2**63), 2**64 - 1, "a\"b\\", "\u2028", "\x00", "}]", None,
                              True, {"a": [1, {"b": "]"}]}, [[[]]], "\\" * r.randrange(5), '"' * r.randrange(5)]
        values = [r.choice(choices) for _ in range(r.randrange(4))]
        out = b"".join(b"," + r.choice([b"", b" ", b"\n\t"]) + json.dumps(v, ensure_ascii=r.random() < 0.5).encode()
                       for v in values)
        if r.random() < 0.3:
            out += r.choice(ATOMS)
        return out
    return b"".join(r.choice(ATOMS) for _ in range(r.randrange(8)))


def base(r: random.Random, tag: int) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "s" * 1100}]
    for i in range(r.randrange(2, 7)):
        msgs.append({"role": "user", "content": r.choice([f"m{i}", "\\\"" * i, '"]' * i, [{"t": i}], None, 1.0])})
    body: dict[str, Any] = {"model": "m", "messages": msgs}
    for key in r.sample(["tools", "stream", "z", "n", "max_tokens"], r.randrange(4)):
        body[key] = r.choice([[{"a": "]"}], False, "tail\\", 3, {"k": [1, 2]}])
    body["tag"] = tag
    return body


def dump(r: random.Random, body: dict[str, Any]) -> bytes:
    style = r.randrange(3)
    if style == 0:
        return orjson.dumps(body)
    if style == 1:
        return json.dumps(body, indent=r.choice([None, 1, "\t"]), ensure_ascii=r.random() < 0.5).encode()
    return json.dumps(body, separators=(" , ", " : ")).encode()


def check(memory: KnownBodies, raw: bytes, tenant: str, failures: list[Any]) -> None:
    got = outcome(lambda: memory.parse(raw, tenant, "chat", "messages", read_json_body))
    want = outcome(lambda: read_json_body(raw)[0])
    if not strict(got, want):
        failures.append((raw, got, want))


def test_splices_at_remembered_places() -> None:
    r = random.Random(7)
    failures: list[Any] = []
    for trial in range(150):
        memory = KnownBodies(min_bytes=0)
        body = base(r, trial % 3)
        for step in range(12):
            raw = dump(r, body)
            check(memory, raw, r.choice(["a", "a", "b"]), failures)
            # splice hostile bytes at remembered places
            for bucket in list(memory._buckets.values()):
                for known in list(bucket.bodies):
                    for offset, _ in known.cuts:
                        for _ in range(3):
                            mid = hostile(r)
                            cut = offset - r.choice([0, 0, 0, 1, 2])
                            spliced = known.raw[:cut] + mid + known.raw[known.tail:]
                            check(memory, spliced, "a", failures)
            op = r.random()
            msgs = body["messages"]
            if op < 0.5:
                msgs.append({"role": "user", "content": r.choice(["x" * r.randrange(50), {"q": "\\"}, ["]"]])})
            elif op < 0.7 and len(msgs) > 3:
                msgs[-1] = {"role": "assistant", "content": f"retry {step}"}
            elif op < 0.85 and len(msgs) > 3:
                del msgs[r.randrange(2, len(msgs)):]
            else:
                body = {**body, "messages": list(msgs)}
    assert not failures, failures[:3]
