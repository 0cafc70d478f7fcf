"""Goldfish drops against plain-Python references written from SPEC.md 4.1."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apertus_plugins.core.goldfish import (
    TABLE_SEED,
    TABLE_SIZE,
    goldfish_drop,
    goldfish_keys,
    goldfish_table,
    order_sensitive_coefficients,
    pack_table,
    unpack_table,
)
from apertus_plugins.core.vocab import VocabSpec

SPEC = VocabSpec.scaled()
FULL = VocabSpec()
M64 = 1 << 64


def signed(v: int) -> int:
    v %= M64
    return v - M64 if v >= 1 << 63 else v


def ref_coefficients(h: int) -> list[int]:
    gen = np.random.Generator(np.random.PCG64(TABLE_SEED + h))
    return [int(c) | 1 for c in gen.integers(0, 2**62, size=h, dtype=np.int64)]


def ref_drop(labels: list[int], k: int, h: int, variant: str, spec: VocabSpec) -> list[bool]:
    """Per position: the int64 product (or weighted sum) of the window, floor-mod, table test."""
    table = goldfish_table()
    special = spec.special_ids
    coeffs = ref_coefficients(h)
    out = []
    for j, label in enumerate(labels):
        if j < h - 1 or label in special or spec.omni_offset <= label < spec.omni_offset + spec.omni_size:
            out.append(False)
            continue
        window = labels[j - h + 1 : j + 1]
        acc = 1 if variant == "hashtable" else 0
        for i, x in enumerate(window):
            acc = signed(acc * x) if variant == "hashtable" else signed(acc + coeffs[i] * x)
        key = acc % TABLE_SIZE  # Python's % is floor-mod, like torch's remainder
        out.append(bool(table[key] < np.float32(1 / k)))
    return out


def test_table_shape_and_values() -> None:
    t = goldfish_table()
    assert t.shape == (TABLE_SIZE,) and t.dtype == np.float32
    assert 0.0 <= float(t.min()) and float(t.max()) < 1.0
    assert abs(float(t.mean()) - 0.5) < 1e-3
    assert np.array_equal(unpack_table(pack_table(t)).view(np.uint32), t.view(np.uint32))
    with pytest.raises(ValueError):
        t[0] = 1.0  # read-only


def test_coefficients_are_odd_62_bit() -> None:
    c = order_sensitive_coefficients(50)
    assert c.tolist() == ref_coefficients(50)
    assert all(x % 2 == 1 and 0 < x < 2**62 for x in c.tolist())
    assert order_sensitive_coefficients(7).tolist() != c[:7].tolist()


@pytest.mark.parametrize("variant", ["hashtable", "order-sensitive"])
@pytest.mark.parametrize("h", [1, 2, 3, 5, 8, 13, 50, 64])
def test_keys_match_reference(variant: str, h: int) -> None:
    rng = np.random.default_rng(h)
    for spec in (SPEC, FULL):
        x = rng.integers(0, spec.size, 400)
        keys = goldfish_keys(x, h, variant)
        coeffs = ref_coefficients(h)
        want = []
        for s in range(len(x) - h + 1):
            acc = 1 if variant == "hashtable" else 0
            for i in range(h):
                v = int(x[s + i])
                acc = signed(acc * v) if variant == "hashtable" else signed(acc + coeffs[i] * v)
            want.append(acc % TABLE_SIZE)
        assert keys.tolist() == want


@pytest.mark.parametrize("variant", ["hashtable", "order-sensitive"])
@pytest.mark.parametrize("seed", range(6))
def test_drops_match_reference(variant: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    k, h = [(2, 3), (4, 5), (50, 50), (3, 13), (10, 1), (7, 2)][seed]
    for spec in (SPEC, FULL):
        alpha = np.concatenate([rng.integers(1, spec.size, 64), np.fromiter(spec.special_ids, np.int64)[:20], [0, 2]])
        x = rng.choice(alpha, 600)
        got = goldfish_drop(x, k=k, h=h, variant=variant, spec=spec)
        assert got.tolist() == ref_drop(x.tolist(), k, h, variant, spec)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, SPEC.size - 1), max_size=40), st.integers(1, 8), st.integers(1, 6),
       st.sampled_from(["hashtable", "order-sensitive"]))
def test_drops_match_reference_hypothesis(labels: list[int], h: int, k: int, variant: str) -> None:
    got = goldfish_drop(np.array(labels, dtype=np.int64), k=k, h=h, variant=variant, spec=SPEC)
    assert got.tolist() == ref_drop(labels, k, h, variant, SPEC)


def test_drop_rate_about_one_in_k() -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(75, FULL.size, 400_000)
    rate = goldfish_drop(x, k=50, h=50, variant="order-sensitive", spec=FULL).mean()
    assert 0.018 < rate < 0.022
    # the public product hash: ~1/k among windows whose product is not 0 mod 2**64
    odd = x | 1
    rate = goldfish_drop(odd, k=50, h=50, variant="hashtable", spec=FULL).mean()
    assert 0.018 < rate < 0.022
    rate = goldfish_drop(x, k=10, h=4, variant="hashtable", spec=FULL).mean()
    assert 0.09 < rate < 0.11


def test_exempt_never_drop_and_codes_eligible() -> None:
    rng = np.random.default_rng(1)
    special = np.fromiter(FULL.special_ids, np.int64)
    x = rng.choice(np.concatenate([special, rng.integers(0, FULL.size, 500)]), 200_000)
    drop = goldfish_drop(x, k=2, h=2, spec=FULL, variant="order-sensitive")
    assert not drop[np.isin(x, special)].any()
    assert not drop[(x >= FULL.omni_offset) & (x < FULL.omni_offset + FULL.omni_size)].any()
    codes = x >= FULL.modalities[0].offset
    assert drop[codes].mean() > 0.3
    assert not goldfish_drop(x[:49], k=1, h=50, spec=FULL).any()  # first h-1 never drop


def test_chunking_and_batching_are_deterministic() -> None:
    rng = np.random.default_rng(2)
    x = rng.integers(75, FULL.size, 10_000)
    for variant in ("hashtable", "order-sensitive"):
        whole = goldfish_drop(x, k=5, h=50, variant=variant, spec=FULL)
        cuts = [0, 7, 49, 50, 1234, 5000, 9999, 10_000]
        parts = [goldfish_drop(x[a:b], k=5, h=50, variant=variant, spec=FULL, context=x[:a])
                 for a, b in zip(cuts, cuts[1:], strict=False)]
        assert np.concatenate(parts).tolist() == whole.tolist()
        batch = goldfish_drop(np.stack([x[:500], x[500:1000]]), k=5, h=50, variant=variant, spec=FULL)
        assert batch[0].tolist() == whole[:500].tolist()
        assert batch[1].tolist() == goldfish_drop(x[500:1000], k=5, h=50, variant=variant, spec=FULL).tolist()
        ctx = np.stack([x[451:500], x[951:1000]])
        batch = goldfish_drop(np.stack([x[500:1000], x[1000:1500]]), k=5, h=50, variant=variant, spec=FULL,
                              context=ctx)
        assert batch.reshape(-1).tolist() == whole[500:1500].tolist()


def test_errors_and_disabled() -> None:
    with pytest.raises(ValueError, match="variant"):
        goldfish_drop([1, 2, 3], variant="xor")
    with pytest.raises(ValueError, match="h must"):
        goldfish_keys([1, 2], h=0)
    with pytest.raises(ValueError, match="non-negative"):
        goldfish_drop([-1, 5], h=1, k=1)
    assert not goldfish_drop([100] * 10, k=0, h=1, spec=SPEC).any()
    assert goldfish_drop([], spec=SPEC).shape == (0,)


def test_the_goldfish_config_is_the_typed_form_of_the_keyword_arguments() -> None:
    from apertus_plugins.core.goldfish import GoldfishConfig

    labels = np.random.default_rng(3).integers(100, 500, size=4000)
    cfg = GoldfishConfig(k=4, h=3, variant="order-sensitive")
    assert np.array_equal(cfg.drop(labels), goldfish_drop(labels, k=4, h=3, variant="order-sensitive"))
    assert GoldfishConfig.coerce({"k": 4, "h": 3, "variant": "order-sensitive"}) == cfg
    assert GoldfishConfig.coerce(cfg) is cfg and GoldfishConfig.coerce(None) is None
    assert GoldfishConfig.coerce({"k": 0}) is None  # goldfish_drop's rule: k <= 0 drops nothing
    assert GoldfishConfig() == GoldfishConfig(k=50, h=50, variant="hashtable", on_sft=False)  # the report's
    assert cfg.describe() == "k=4 h=3 order-sensitive"


@pytest.mark.parametrize(("fields", "message"), [
    ({"k": 0}, "k must be >= 1"), ({"h": 0}, "h must be >= 1"), ({"variant": "sorted"}, "unknown Goldfish variant"),
])
def test_a_bad_goldfish_setting_names_the_field(fields: dict, message: str) -> None:
    from apertus_plugins.core.goldfish import GoldfishConfig

    with pytest.raises(ValueError, match=message):
        GoldfishConfig(**fields)
    with pytest.raises(ValueError, match="unknown Goldfish settings"):
        GoldfishConfig.coerce({"k": 5, "window": 3})
