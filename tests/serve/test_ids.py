"""Request ids made by the proxy: version-4 UUIDs, unique within a process and between processes."""

from __future__ import annotations

import itertools
import subprocess
import sys
import uuid

from proxy.serve.ids import COUNTED_BITS, RequestIds


def test_ids_are_version_4_uuids_in_their_canonical_form() -> None:
    ids = RequestIds()
    for _ in range(100):
        rid = ids.new()
        parsed = uuid.UUID(rid)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert str(parsed) == rid


def test_ids_of_one_process_never_repeat_even_where_the_count_wraps() -> None:
    ids = RequestIds()
    ids._count = itertools.count((1 << COUNTED_BITS) - 5)  # the node field's last values
    made = [ids.new() for _ in range(10)]
    assert len(set(made)) == 10
    assert made[5].endswith("000000000000") and all(len(r) == 36 for r in made)


def test_two_generators_and_two_processes_make_different_ids() -> None:
    a, b = RequestIds(), RequestIds()
    assert {a.new() for _ in range(1000)}.isdisjoint({b.new() for _ in range(1000)})
    script = "from proxy.serve.ids import RequestIds; print(RequestIds().new())"
    made = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(made) == 2
