"""validate_tree_attention_args: good input gives the facts, each bad input a ValueError that
names the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeverify.check import Case, make_inputs, parents_to_mask_rows
from treeverify.kernels import tree_attention, validate_tree_attention_args

ORDER = ("q", "k_cache", "v_cache", "block_table", "prefix_lens", "qo_indptr", "tree_mask")
GQA = Case("gqa", 8, 2, 64, 64, False, 16, (0, 40, 100), (5, 40, 1))
MLA = Case("mla", 2, 1, 576, 512, True, 16, (20,), (6,))


def inputs(case=GQA, dtype=torch.float32, seed=0):
    return make_inputs(case, dtype, "cpu", seed)


def call(inp, check_data=True, out=None):
    return validate_tree_attention_args(
        *[inp[k] for k in ORDER], inp["sm_scale"],
        v_head_dim=inp["v_head_dim"], out=out, check_data=check_data,
    )  # fmt: skip


def expect(inp, name, *fragments, **kw):
    with pytest.raises(ValueError) as info:
        call(inp, **kw)
    message = str(info.value)
    assert message.startswith(f"{name}: "), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def set_row(inp, row, visible, words=None):
    """Replace q row `row`'s mask with the given visible node ids."""
    words = words or inp["tree_mask"].shape[1]
    bits = np.zeros(32 * words, dtype=bool)
    bits[list(visible)] = True
    packed = np.packbits(bits, bitorder="little").view("<u4").view(np.int32)
    inp["tree_mask"][row] = torch.from_numpy(packed.copy())


def test_good_input_facts():
    facts = call(inputs())
    assert (facts.batch, facts.total_q, facts.hq, facts.hkv, facts.group) == (3, 46, 8, 2, 4)
    assert (facts.dqk, facts.dv, facts.page_size, facts.is_mla) == (64, 64, 16, False)
    assert (facts.words, facts.max_tree) == (2, 40)
    assert call(inputs(), check_data=False).max_tree is None
    mla = call(inputs(MLA))
    assert mla.is_mla and (mla.dqk, mla.dv, mla.words, mla.max_tree) == (576, 512, 1, 6)


def test_message_format_example():
    inp = inputs()
    inp["tree_mask"] = inp["tree_mask"].long()
    message = expect(inp, "tree_mask")
    assert message == (
        "tree_mask: expected int32 tensor of shape (total_q=46, W>=1), "
        "got torch.int64 (46, 2) on cpu"
    )


@pytest.mark.parametrize(
    "name,mutate,fragment",
    [
        ("q", lambda d: d.update(q=d["q"][0]), "(total_q, Hq, Dqk)"),
        ("q", lambda d: d.update(q=d["q"].int()), "float16/bfloat16/float32"),
        ("q", lambda d: d.update(q=d["q"].numpy()), "ndarray"),
        ("k_cache", lambda d: d.update(k_cache=d["k_cache"].half()), "same dtype as q"),
        ("k_cache", lambda d: d.update(k_cache=d["k_cache"][..., :32]), "Dqk=64"),
        ("k_cache", lambda d: d.update(k_cache=d["k_cache"][:, :, :1].repeat(1, 1, 3, 1)), "Hq=8"),
        ("v_cache", lambda d: d.update(v_cache=d["v_cache"][:, :8]), "page_size=16"),
        ("v_cache", lambda d: d.update(v_cache=d["v_cache"].double()), "same dtype as q"),
        ("v_head_dim", lambda d: d.update(v_head_dim=32), "v_cache's Dv=64"),
        ("v_head_dim", lambda d: d.update(v_cache=None), "when v_cache is None"),
        ("block_table", lambda d: d.update(block_table=d["block_table"].long()), "int32"),
        ("block_table", lambda d: d.update(block_table=d["block_table"][:2]), "(B=3,"),
        ("prefix_lens", lambda d: d.update(prefix_lens=d["prefix_lens"][:2]), "(B=3,)"),
        ("prefix_lens", lambda d: d.update(prefix_lens=d["prefix_lens"].float()), "int32"),
        ("qo_indptr", lambda d: d.update(qo_indptr=d["qo_indptr"].long()), "int32"),
        ("qo_indptr", lambda d: d.update(qo_indptr=d["qo_indptr"][:1]), "B >= 1"),
        ("tree_mask", lambda d: d.update(tree_mask=d["tree_mask"][:-1]), "total_q=46"),
        ("sm_scale", lambda d: d.update(sm_scale=float("nan")), "finite float"),
        ("sm_scale", lambda d: d.update(sm_scale="0.1"), "finite float"),
        ("k_cache", lambda d: d.update(k_cache=d["k_cache"].to("meta")), "q's device cpu"),
        ("tree_mask", lambda d: d.update(tree_mask=d["tree_mask"].to("meta")), "q's device"),
    ],
)
def test_shape_dtype_device_errors(name, mutate, fragment):
    inp = inputs()
    mutate(inp)
    expect(inp, name, fragment, check_data=False)  # caught without reading any data


def test_mla_v_head_dim_bounds():
    inp = inputs(MLA)
    inp["v_head_dim"] = 577
    expect(inp, "v_head_dim", "[1, Dqk=576]")
    inp["v_head_dim"] = None
    expect(inp, "v_head_dim", "MLA")


@pytest.mark.parametrize(
    "out,fragment",
    [
        (torch.empty(46, 8, 32), "(total_q=46, Hq=8, Dv=64)"),
        (torch.empty(46, 8, 64, dtype=torch.bfloat16), "torch.float32 tensor"),
        (torch.empty(46, 8, 64, device="meta"), "on cpu"),
        (np.empty((46, 8, 64)), "ndarray"),
    ],
)
def test_out_errors(out, fragment):
    expect(inputs(), "out", fragment, out=out, check_data=False)


def test_qo_indptr_values():
    inp = inputs()
    inp["qo_indptr"] = torch.tensor([1, 5, 45, 46], dtype=torch.int32)
    expect(inp, "qo_indptr", "start at 0")
    inp["qo_indptr"] = torch.tensor([0, 5, 45, 45], dtype=torch.int32)
    expect(inp, "qo_indptr", "end at total_q=46")
    inp["qo_indptr"] = torch.tensor([0, 5, 5, 46], dtype=torch.int32)
    expect(inp, "qo_indptr", "T_b >= 1", "T_1 = 0")
    inp["qo_indptr"] = torch.tensor([0, 45, 5, 46], dtype=torch.int32)
    expect(inp, "qo_indptr", "T_1 = -40")


def test_prefix_lens_negative():
    inp = inputs()
    inp["prefix_lens"][1] = -1
    expect(inp, "prefix_lens", "prefix_lens[1] = -1")


def test_block_table_too_narrow():
    inp = inputs()
    inp["prefix_lens"][2] = 100 + 16 * 3  # now needs 10 pages; the table has 8 columns
    expect(inp, "block_table", "request 2 needs 10 pages")


@pytest.mark.parametrize("bad_id", [-1, 10_000])
def test_page_id_out_of_range(bad_id):
    inp = inputs()
    inp["block_table"][1, 2] = bad_id
    expect(inp, "block_table", f"block_table[1, 2] = {bad_id}", "num_pages=")


def test_unused_block_table_entries_are_not_checked():
    inp = inputs()
    assert (inp["block_table"][0, 1:] == -1).all()  # request 0 uses one page only
    call(inp)


def test_tree_mask_too_narrow():
    inp = inputs()
    inp["tree_mask"] = inp["tree_mask"][:, :1].contiguous()
    expect(inp, "tree_mask", "W>=2", "max T_b=40")


# request 1 (P=40, T=40) starts at q row 5
R1 = 5


@pytest.mark.parametrize(
    "row,visible,fragment",
    [
        (R1 + 3, [3], "no parent"),  # a second root
        (R1 + 0, [0, 1], "sees later node 1"),  # root sees a later node
        (R1 + 4, [0, 4, 7], "sees later node 7"),
        (R1 + 39, [0, 39, 40], "bit 40 set beyond the tree size T_b=40"),
        (R1 + 4, [0], "bit 4 (itself) is not set"),
        (0 + 4, [0, 4, 6], "bit 6 set beyond the tree size T_b=5"),  # request 0, T=5
    ],
)
def test_tree_mask_bad_rows(row, visible, fragment):
    inp = inputs()
    set_row(inp, row, visible)
    message = expect(inp, "tree_mask", fragment)
    assert f"(q row {row})" in message


def test_tree_mask_not_a_tree():
    inp = inputs()
    parents = [-1, 0, 1, 2] + [0] * 36  # chain 0 <- 1 <- 2 <- 3, the rest children of the root
    inp["tree_mask"][R1 : R1 + 40] = torch.from_numpy(parents_to_mask_rows(parents, 2).copy())
    call(inp)
    set_row(inp, R1 + 3, [0, 3])  # node 3 re-parented to the root: still a tree
    call(inp)
    set_row(inp, R1 + 2, [1, 2])  # sees its parent 1 but not 1's parent 0
    expect(inp, "tree_mask", "row 2 (q row 7)", "not a tree", "parent 1")


def test_bit_31_sign_bit_is_handled():
    case = Case("wide", 2, 1, 16, 16, False, 16, (3,), (64,))
    inp = inputs(case)
    assert (inp["tree_mask"] < 0).any()  # chains through node 31 set the int32 sign bit
    call(inp)


def test_eager_entry_validates():
    inp = inputs()
    inp["block_table"][2, 0] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        tree_attention(*[inp[k] for k in ORDER], inp["sm_scale"], v_head_dim=None, backend="torch")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=0, max_size=80))
def test_any_topological_tree_is_accepted(draws):
    parents = [-1] + [d % i for i, d in enumerate(draws, start=1)]
    t = len(parents)
    words = -(-t // 32)
    rows = parents_to_mask_rows(parents, words)
    # independent check of the packing: bit j of row i set iff j is i or an ancestor of i
    for i in range(t):
        anc, j = set(), i
        while j >= 0:
            anc.add(j)
            j = parents[j]
        got = {j for j in range(32 * words) if (int(rows[i, j // 32]) >> (j % 32)) & 1}
        assert got == anc
    case = Case("h", 2, 1, 8, 8, False, 16, (5,), (t,))
    inp = inputs(case)
    inp["tree_mask"] = torch.from_numpy(rows.copy())
    assert call(inp).max_tree == t
