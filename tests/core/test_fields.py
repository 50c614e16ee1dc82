"""proxy.core.fields: key folding as Go's encoding/json matches struct fields, and what counts as a variant."""

from __future__ import annotations

import pytest

from proxy.core.errors import PayloadError
from proxy.core.fields import STRUCTURAL_FIELDS, case_variant, check_keys, go_fold

FIELDS = frozenset({"model", "max_tokens", "messages"})


@pytest.mark.parametrize(("key", "field"), [
    ("Model", "model"), ("MODEL", "model"), ("max_token\u017f", "max_tokens"), ("max_to\u212aens", "max_tokens"),
    ("me\u017f\u017fages", "messages"),
])
def test_variants_fold_onto_the_field(key: str, field: str) -> None:
    assert go_fold(key) == field
    assert case_variant(key, FIELDS) == field


@pytest.mark.parametrize("key", ["model", "max_tokens", "user", "X-Custom", "Temperature", "modelo", "_", ""])
def test_exact_names_and_other_keys_are_not_variants(key: str) -> None:
    assert case_variant(key, FIELDS) is None


def test_check_keys_refuses_only_variants_of_structural_fields() -> None:
    check_keys({"role": "user", "content": "hi", "Extra": 1, "cacheHint": True})
    assert "content" in STRUCTURAL_FIELDS
    with pytest.raises(PayloadError) as caught:
        check_keys({"role": "user", "content": "hi", "Content": [{"type": "text", "text": "more"}]})
    assert caught.value.code == "ambiguous_field" and "'Content'" in caught.value.message
