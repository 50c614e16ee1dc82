"""The memory bound of KnownBodies (max_bytes, counted by ``weigh``)."""

from __future__ import annotations

import tracemalloc

import orjson

from proxy.serve.bodies import KnownBodies, read_json_body


def float_body(i: int, n: int = 60_000) -> bytes:
    """A body whose last message holds n short floats: weigh() counts ~4 bytes each; Python holds a 24-byte float
    object plus an 8-byte list slot for each (orjson makes a new float object per value)."""
    return (b'{"model":"m","messages":[{"role":"system","content":"conversation %d ' % i + b"s" * 1100
            + b'"},{"role":"user","content":[' + b",".join([b"1.5"] * n) + b']},{"role":"user","content":"x"}]}')


def test_weigh_undercounts_numbers_eightfold() -> None:
    max_bytes = 2 * 1024 * 1024
    tracemalloc.start()
    try:
        memory = KnownBodies(max_bytes=max_bytes)
        base = tracemalloc.get_traced_memory()[0]
        for conversation in range(40):
            raw = float_body(conversation)
            for _ in range(2):  # read back the second time its bucket misses
                memory.parse(raw, "t", "chat", "messages", read_json_body)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert memory.size <= max_bytes
    assert held <= 2 * max_bytes, f"{held / 2**20:.1f} MiB held for max_bytes {max_bytes / 2**20:.1f} MiB " \
                                  f"(size says {memory.size / 2**20:.1f} MiB)"


def test_one_bucket_holds_twice_max_bytes() -> None:
    """_shrink never drops the last bucket, and a bucket keeps BRANCHES (8) bodies of up to max_bytes/4 each: one
    conversation's bucket (a client that branches) holds up to 2 x max_bytes."""
    max_bytes = 400_000
    memory = KnownBodies(max_bytes=max_bytes)
    head = {"role": "system", "content": "s" * 1100}
    pad = "p" * 80_000  # weigh ~ 80 KB < max_bytes / 4

    def raw(branch: int, n: int) -> bytes:
        msgs = [head, {"role": "user", "content": pad}] + [{"role": "user", "content": f"b{branch} {i}"}
                                                            for i in range(n)]
        return orjson.dumps({"model": "m", "messages": msgs, "tail": branch})  # another tail: another branch

    for branch in range(8):
        for n in (1, 1, 2):  # miss, miss (read back), reuse (proven)
            memory.parse(raw(branch, n), "t", "chat", "messages", read_json_body)
    assert len(memory._buckets) == 1
    assert memory.size <= max_bytes, f"size {memory.size} > max_bytes {max_bytes}"
