"""The Hopper TMA kernels' host side (``hopper.py``, ``MoEConfig.hopper``) on CPU: no GPU needed.

Which configs ``validate_config`` takes (the combinations Triton 3.6 cannot compile are refused with the
reason), and that every launch the Hopper layer makes binds to the kernel's parameters as Triton's own JIT
binds it: the launches are recorded on CPU tensors and bound for an sm_90 target, so a renamed, missing or
extra argument fails here and not at the first launch on a GPU. ``tools/sm90_compile_hopper_moe.py`` goes on
to compile them.
"""

from __future__ import annotations

import pytest
import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.kernels.triton_moe.config import (
    WARP_SPECIALIZE_ENV,
    GemmConfig,
    MoEConfig,
    gluon_pair_config,
    validate_config,
    weight_scale_span,
)
from triton_launches import Recorder, bind


def _cfg(bm=64, warps=4, *, pers=False, gather=False, paired=False, ws=False, fold=False, bn1=64, bn2=128, bk=128):
    return MoEConfig(
        bm,
        GemmConfig(bn1, bk, 8, warps, 3, persistent=pers, warp_specialize=ws, paired=paired),
        GemmConfig(bn2, bk, 8, warps, 3, persistent=pers, warp_specialize=ws),
        fold,
        True,
        gather,
    )


@pytest.fixture(autouse=True)
def _warp_specialization_opted_in(monkeypatch):
    """These tests check what Triton 3.6 compiles; running it needs the developer opt-in (wrong results on the H100)."""
    monkeypatch.setenv(WARP_SPECIALIZE_ENV, "1")


def test_warp_specialization_is_refused_without_the_opt_in(monkeypatch):
    monkeypatch.delenv(WARP_SPECIALIZE_ENV)
    with pytest.raises(KernelInputError, match=f"computed wrong layers on an H100.*{WARP_SPECIALIZE_ENV}=1"):
        validate_config(_cfg(ws=True, gather=True), block_fp8=True)
    validate_config(_cfg(gather=True, pers=True), block_fp8=True)


def test_w1_warp_specialization_needs_the_gathered_input():
    with pytest.raises(KernelInputError, match="w1.warp_specialize without gather_input"):
        validate_config(_cfg(ws=True), block_fp8=True)
    validate_config(_cfg(ws=True, gather=True), block_fp8=True)
    validate_config(_cfg(ws=True, gather=True, pers=True), block_fp8=False)


@pytest.mark.parametrize(
    "config,block_fp8,match",
    [
        (_cfg(ws=True, gather=True, paired=True), False, "w1.warp_specialize with w1.paired"),
        (_cfg(ws=True, gather=True, fold=True), False, "w2.warp_specialize with fold_topk"),
        (_cfg(ws=True, gather=True, bn1=256), False, "w1.warp_specialize with block_m=64 and block_n=256"),
        (_cfg(ws=True, gather=True, bn2=256), False, "w2.warp_specialize with block_m=64 and block_n=256"),
        (_cfg(128, ws=True, gather=True, bn1=128), True, "block FP8, block_m=128, w1.block_n=128"),
    ],
)
def test_warp_specialization_refuses_what_triton_cannot_partition(config, block_fp8, match):
    with pytest.raises(KernelInputError, match=match):
        validate_config(config, block_fp8=block_fp8)


def test_warp_specialization_takes_what_compiles():
    for config, block_fp8 in (
        (_cfg(128, ws=True, gather=True, bn1=128, bn2=256, bk=64), False),  # bf16 bm128, the w1 tile stored by pointers
        (_cfg(128, ws=True, gather=True, bn1=64), True),  # block FP8 quantized after the GEMM
        (_cfg(64, ws=True, gather=True, bn1=128), True),  # block FP8, 1x128 groups in the epilogue at 64 rows
        (MoEConfig(64, GemmConfig(64, 128, 8, 4, 3, warp_specialize=True), GemmConfig(128, 128, 8, 8, 3), True, True,
                   True), True),  # fold_topk with only w1 specialized
    ):
        validate_config(config, block_fp8=block_fp8)


def test_warp_specialization_takes_four_warps():
    with pytest.raises(KernelInputError, match="w1.warp_specialize with num_warps=8"):
        validate_config(_cfg(128, 8, ws=True, gather=True), block_fp8=False)
    w2_only = MoEConfig(64, GemmConfig(64, 64, 8, 4), GemmConfig(128, 64, 8, 8, warp_specialize=True), False, True)
    with pytest.raises(KernelInputError, match="w2.warp_specialize with num_warps=8"):
        validate_config(w2_only, block_fp8=False)


@pytest.mark.parametrize(
    "config,match",
    [
        (MoEConfig(64, GemmConfig(64, 64, persistent=True), GemmConfig(64, 64)), "set hopper too"),
        (MoEConfig(64, GemmConfig(64, 64, persistent=True, flatten=True), GemmConfig(64, 64)), "set hopper too"),
        (MoEConfig(64, GemmConfig(64, 64), GemmConfig(64, 64, flatten=True), False, True), "w2.flatten .* set persistent"),
        (MoEConfig(64, GemmConfig(64, 64), GemmConfig(64, 64, persistent=True, flatten=True), True, True),
         "w2.flatten with fold_topk"),
        (MoEConfig(64, GemmConfig(64, 64), GemmConfig(64, 64), gather_input=True), "set hopper too"),
        (MoEConfig(64, GemmConfig(64, 64), GemmConfig(64, 64, paired=True), False, True), "w2.paired"),
        (MoEConfig(32, GemmConfig(64, 64), GemmConfig(64, 64), False, True), "block_m >= 64"),
        (MoEConfig(64, GemmConfig(64, 64, swap_ab=True), GemmConfig(64, 64), False, True), "no swap_ab"),
        (MoEConfig(64, GemmConfig(512, 64), GemmConfig(64, 64), False, True), "powers of two|at most 256"),
    ],
)
def test_other_hopper_refusals(config, match):
    with pytest.raises(KernelInputError, match=match):
        validate_config(config, block_fp8=False)


def _gluon(bm=64, warps=4, bn1=64, bn2=128, bk=128, ws=False, persistent=False):
    flags = dict(warp_specialize=ws, persistent=persistent)
    return MoEConfig(bm, GemmConfig(bn1, bk, 8, warps, 4, **flags), GemmConfig(bn2, bk, 8, warps, 4, **flags), False,
                     True, True, True)


def test_gluon_takes_block_fp8_tiles_of_one_wgmma_per_warpgroup():
    # 64-row blocks in 8 warps: two warpgroups side by side, each a 64-row wgmma over its own half of a tile twice
    # as wide
    for config in (_gluon(), _gluon(128, 8), _gluon(bn1=32, bn2=64), _gluon(64, 8, bn1=128, bn2=256),
                   _gluon(64, 8, bn1=64, bn2=128), gluon_pair_config()):
        validate_config(config, block_fp8=True)
    assert MoEConfig.from_json(_gluon().to_json()) == _gluon()
    assert "gluon" not in _cfg().to_json()


@pytest.mark.parametrize(
    "config,block_fp8,match",
    [
        (_gluon(), False, "block-FP8 layers only"),
        (MoEConfig(64, GemmConfig(64, 128, 8, 4), GemmConfig(128, 128, 8, 4), False, True, False, True), True,
         "needs hopper and gather_input"),
        (MoEConfig(64, GemmConfig(64, 128, 8, 4), GemmConfig(128, 128, 8, 4), True, True, True, True), True,
         "no fold_topk"),
        (_gluon(bk=64), True, "gluon w1: block_k 128"),
        (_gluon(bn1=128), True, "gluon w1: .*block_n in \\(32, 64\\)"),
        (_gluon(bn2=256), True, "gluon w2: .*block_n in \\(64, 128\\)"),
        (_gluon(128, 4), True, "block_m = 16 x num_warps"),
        (_gluon(32, 8), True, "block_m = 8 x num_warps \\(two warpgroups side by side\\)"),
        (_gluon(64, 8, bn1=256, bn2=256), True, "gluon w1: .*block_n in \\(64, 128\\)"),
        (_gluon(64, 8, bn1=128, bn2=512), True, "gluon w2: .*block_n in \\(128, 256\\)"),
        (MoEConfig(64, GemmConfig(128, 128, 8, 8, 5), GemmConfig(256, 128, 8, 8, 5), False, True, True, True), True,
         "gluon w2: 5 stages .* need 237,568 bytes"),
        (MoEConfig(128, GemmConfig(64, 128, 8, 8, 7), GemmConfig(128, 128, 8, 8, 4), False, True, True, True), True,
         "gluon w1: 7 stages .* need 245,760 bytes"),
    ],
)
def test_gluon_refusals_name_what_is_accepted(config, block_fp8, match):
    with pytest.raises(KernelInputError, match=match):
        validate_config(config, block_fp8=block_fp8)


def test_gluon_refuses_the_triton_kernel_options_and_takes_its_own_warp_specialization(monkeypatch):
    config = MoEConfig(64, GemmConfig(64, 128, 8, 4, 4, persistent=True), GemmConfig(128, 128, 8, 4, 4), False, True,
                       True, True)
    with pytest.raises(KernelInputError, match="persistent needs warp_specialize"):
        validate_config(config, block_fp8=True)
    paired = MoEConfig(64, GemmConfig(64, 128, 8, 4, 4, paired=True), GemmConfig(128, 128, 8, 4, 4), False, True,
                       True, True)
    with pytest.raises(KernelInputError, match="options of the Triton kernels"):
        validate_config(paired, block_fp8=True)
    monkeypatch.delenv(WARP_SPECIALIZE_ENV)  # Triton's automatic partitions need the opt-in, Gluon's do not
    ws = MoEConfig(128, GemmConfig(64, 128, 8, 8, 4, persistent=True, warp_specialize=True),
                   GemmConfig(128, 128, 8, 8, 4, persistent=True, warp_specialize=True), False, True, True, True)
    validate_config(ws, block_fp8=True)
    four_warps = MoEConfig(64, GemmConfig(64, 128, 8, 4, 4, warp_specialize=True),
                           GemmConfig(128, 128, 8, 4, 4, warp_specialize=True), False, True, True)
    with pytest.raises(KernelInputError, match="so it is refused"):
        validate_config(four_warps, block_fp8=True)
    validate_config(MoEConfig(64, four_warps.w1, four_warps.w2, False, True, True, True), block_fp8=True)


def test_hopper_fields_survive_a_table():
    config = _cfg(pers=True, gather=True, paired=True, ws=True, fold=True)
    assert MoEConfig.from_json(config.to_json()) == config
    assert "warp_specialize" not in MoEConfig(64, GemmConfig(64, 64), GemmConfig(64, 64)).to_json()["w1"]
    flat = MoEConfig(128, GemmConfig(128, 64, 8, 8, 4, persistent=True, paired=True, flatten=True),
                     GemmConfig(256, 64, 8, 8, 4, persistent=True, flatten=True), False, True)
    assert MoEConfig.from_json(flat.to_json()) == flat
    assert "flatten" not in config.to_json()["w1"]


# ---- the launches, bound as Triton binds them (needs Triton, not a GPU) ----


def _record(monkeypatch, fp8, config, num_tokens=64, n=256, k=512, top_k=4, experts=2, float_input=False, sums=None):
    """The Hopper layer's kernel launches for one call, on CPU tensors (``float_input``: a block-FP8 layer's
    input still bf16, left to the Gluon path to quantize); ``sums`` collects what the top-k sum was given."""
    from moe_fsm.kernels.triton_moe import _hopper_kernels, fused, hopper
    from moe_fsm.kernels.triton_moe.align import AlignedRouting, max_padded_rows
    from moe_fsm.kernels.triton_moe.fused import Fp8Spec
    from moe_fsm.kernels.triton_moe.quant import FP8_DTYPE

    calls = []
    for name in ("moe_gemm_tma_kernel", "gather_rows_kernel", "pair_slots_kernel", "quantize_into_slots_kernel",
                 "quantize_real_rows_kernel"):
        kernel = getattr(_hopper_kernels, name)
        kernel = kernel.fn if isinstance(kernel, Recorder) else kernel
        monkeypatch.setattr(_hopper_kernels, name, Recorder(kernel, calls))
    monkeypatch.setattr(hopper, "_sm_count", lambda index: 132)
    monkeypatch.setattr(
        fused, "quantize_activation",
        lambda x, g, s=None: (torch.empty(x.shape, dtype=FP8_DTYPE),
                              torch.empty(x.shape[0], -(-x.shape[1] // 128) if g == "group" else 1)),
    )
    sums = [] if sums is None else sums
    monkeypatch.setattr(fused, "topk_sum", lambda y, ids, e, out, row_of_pair=None: sums.append((y, row_of_pair)) or out)
    dt = FP8_DTYPE if fp8 else torch.bfloat16
    w1, w2 = torch.empty(experts, 2 * n, k, dtype=dt), torch.empty(experts, k, n, dtype=dt)
    a = torch.empty(num_tokens, k, dtype=dt)
    spec = s1 = s2 = a_scale = None
    if fp8 == "block":
        spec = Fp8Spec("block", "group")
        s1, s2 = torch.ones(experts, 2 * n // 128, k // 128), torch.ones(experts, k // 128, n // 128)
        a_scale = None if float_input else torch.ones(num_tokens, k // 128)
        a = torch.empty(num_tokens, k, dtype=torch.bfloat16) if float_input else a
    elif fp8 == "channel":
        spec = Fp8Spec("channel", "token")
        s1, s2, a_scale = torch.ones(experts, 2 * n), torch.ones(experts, k), torch.ones(num_tokens)
    elif fp8 == "tensor":
        spec = Fp8Spec("tensor", "tensor")
        s1, s2, a_scale = torch.ones(experts), torch.ones(experts), torch.ones(1)
    pairs = num_tokens * top_k
    blocks = -(-max_padded_rows(pairs, experts, config.block_m) // config.block_m)
    routing = AlignedRouting(
        torch.zeros(blocks * config.block_m, dtype=torch.int32), torch.zeros(blocks, dtype=torch.int32),
        torch.full((1,), blocks * config.block_m, dtype=torch.int32), config.block_m, pairs, top_k,
    )
    fused._hopper_layer(
        a, a_scale, w1, w2, s1, s2, None, routing, torch.ones(pairs), torch.zeros(num_tokens, top_k, dtype=torch.int32),
        torch.empty(num_tokens, k, dtype=torch.bfloat16), spec=spec, activation="silu", swiglu_limit=None,
        apply_router_weight_on_input=False, config=config, result_dtype=torch.bfloat16,
    )
    return calls


LAUNCH_CASES = [
    (None, _cfg(128, 8, bn1=128, bn2=256, bk=64)),
    (None, _cfg(pers=True, gather=True, ws=True, bk=64)),
    (None, _cfg(pers=True, gather=True, paired=True, bk=64)),
    (None, MoEConfig(128, GemmConfig(128, 64, 8, 8, 4, persistent=True, paired=True, flatten=True),
                     GemmConfig(256, 64, 8, 8, 4, persistent=True, flatten=True), False, True)),
    ("tensor", _cfg(128, 8, pers=True, fold=True, bn1=128, bn2=256)),
    ("channel", _cfg(gather=True, ws=True)),
    ("block", _cfg(64, 8, bn1=128, bn2=256, pers=True, gather=True, paired=True)),
    ("block", _cfg(bn1=64)),
]


@pytest.mark.parametrize("fp8,config", LAUNCH_CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(LAUNCH_CASES)])
def test_every_hopper_launch_binds_to_its_kernel(monkeypatch, fp8, config):
    pytest.importorskip("triton")
    validate_config(config, block_fp8=fp8 == "block")
    calls = _record(monkeypatch, fp8, config)
    names = [fn.__name__ for fn, *_ in calls]
    assert names.count("moe_gemm_tma_kernel") == 2
    assert names.count("gather_rows_kernel") == int(config.gather_input)
    for fn, grid, args, kwargs in calls:
        signature, _ = bind(fn, args, kwargs)
        if fn.__name__ == "moe_gemm_tma_kernel":
            gated = kwargs["GATED"]
            assert signature["w_desc"].startswith("tensordesc<")
            if gated and config.w1.paired:
                assert signature["w_desc"].endswith(f"[2, {config.w1.block_n}, {config.w1.block_k}]>")
            assert kwargs["WARP_SPECIALIZE"] == (config.w1 if gated else config.w2).warp_specialize
            assert kwargs["FLATTEN"] == (config.w1 if gated else config.w2).flatten
            block_n = (config.w1 if gated else config.w2).block_n
            assert kwargs["W_SCALE_SPAN"] == weight_scale_span(block_n, args[fn.arg_names.index("N")], gated)
            # persistent: one program per SM, and NUM_PROGRAMS (a constexpr) one value per device
            assert kwargs["NUM_PROGRAMS"] == (132 if config.w1.persistent else 1)
            if config.w1.persistent:
                assert grid == (132,)


GLUON_LAUNCH_CASES = [
    _gluon(128, 8, ws=True, persistent=True),
    gluon_pair_config(),
    _gluon(64, 4, ws=True),
    _gluon(bn1=32, bn2=64),
]


@pytest.mark.parametrize("float_input", [False, True])
@pytest.mark.parametrize("config", GLUON_LAUNCH_CASES, ids=range(len(GLUON_LAUNCH_CASES)))
def test_every_gluon_launch_binds_to_its_kernel(monkeypatch, config, float_input):
    pytest.importorskip("triton.experimental.gluon")
    from moe_fsm.kernels.triton_moe import _gluon_kernels, fused
    from moe_fsm.kernels.triton_moe.align import max_padded_rows

    validate_config(config, block_fp8=True)
    calls = []
    monkeypatch.setattr(_gluon_kernels, "moe_block_fp8_gemm_kernel",
                        Recorder(_gluon_kernels.moe_block_fp8_gemm_kernel, calls))
    monkeypatch.setattr(fused, "gluon_usable", lambda *args, **kwargs: True)
    monkeypatch.setattr(fused, "expert_runs", lambda routing: (routing.block_expert, routing.block_expert))
    sums = []
    calls += _record(monkeypatch, "block", config, float_input=float_input, sums=sums)
    names = [fn.__name__ for fn, *_ in calls]
    # each pair's sorted row (pair -> slot) serves the top-k sum; float input is quantized straight into sorted
    # order (each token to its slots), FP8 input gathered there
    first = ["pair_slots_kernel"] + (["quantize_into_slots_kernel"] if float_input else ["gather_rows_kernel"])
    (y, row_of_pair), = sums
    slots = next(args for fn, _, args, _ in calls if fn.__name__ == "pair_slots_kernel")[3]
    # w2 writes its rows in sorted order, every slot's (pads too): the sum finds each pair's row by its slot
    sorted_rows = -(-max_padded_rows(64 * 4, 2, config.block_m) // config.block_m) * config.block_m
    assert row_of_pair is slots and y.shape == (sorted_rows, 512)
    # the intermediate is quantized in the rows that hold a pair only
    gemms = ["moe_block_fp8_gemm_kernel", "quantize_real_rows_kernel", "moe_block_fp8_gemm_kernel"]
    assert sorted(names) == sorted(first + gemms)
    for fn, grid, args, kwargs in calls:
        if fn.__name__ == "quantize_into_slots_kernel":
            signature, _ = bind(fn, args, kwargs)
            assert grid == (64, 1) and kwargs["TOP_K"] == 4 and args[fn.arg_names.index("num_groups")] == 4
            assert signature["q_ptr"] == "*fp8e4nv" and args[fn.arg_names.index("q_ptr")].shape == (
                args[fn.arg_names.index("s_ptr")].shape[0], 512)
        if fn.__name__ == "quantize_real_rows_kernel":
            signature, _ = bind(fn, args, kwargs)
            assert grid == (sorted_rows, 1) and signature["q_ptr"] == "*fp8e4nv"
        if fn.__name__ == "pair_slots_kernel":
            bind(fn, args, kwargs)
            assert args[fn.arg_names.index("slot_of_pair_ptr")].tolist() == [-1] * 256
        if fn.__name__ != "moe_block_fp8_gemm_kernel":
            continue
        gemm = config.w1 if kwargs["GATED"] else config.w2
        bind_kwargs = {k: v for k, v in kwargs.items() if k != "maxnreg"}
        signature, _ = bind(fn, args, bind_kwargs)
        # a weight box is a warpgroup's: two warpgroups side by side (block_m = 8 x num_warps) halve it
        split = 16 * gemm.num_warps // config.block_m
        half = (gemm.block_n if kwargs["GATED"] else gemm.block_n // 2) // split
        assert signature["a_desc"].startswith("tensordesc<fp8e4nv[64, 128]" if config.block_m == 64 else
                                              "tensordesc<fp8e4nv[128, 128]")
        assert signature["w_desc"].startswith(f"tensordesc<fp8e4nv[{half}, 128]")
        # the A rows of a block whose second half is pads come in through the half-height box
        assert signature["a_half_desc"].startswith(f"tensordesc<fp8e4nv[{config.block_m // 2}, 128]")
        # the copy engine stores each tile in boxes of up to 64 bf16 columns (128 bytes, its swizzle's span)
        assert signature["out_desc"].startswith(f"tensordesc<bf16[{config.block_m}, {min(gemm.block_n, 64)}]")
        assert (kwargs["WARP_SPECIALIZE"], kwargs["PERSISTENT"]) == (gemm.warp_specialize, gemm.persistent)
        # a warp-specialized program caps its launch registers so its producer warpgroup fits beside the math
        assert ("maxnreg" in kwargs) == gemm.warp_specialize
        # K = 512 is 4 steps of 128 for w1, N = 256 is 2 for w2
        assert kwargs["UNROLL"] == (4 if kwargs["GATED"] else 2)
        tiles = -(-args[fn.arg_names.index("N")] // gemm.block_n)
        max_tiles = tiles * (args[fn.arg_names.index("sorted_ids_ptr")].numel() // config.block_m)
        assert grid == ((min(max_tiles, 132) if gemm.persistent else max_tiles),)


def test_launches_do_not_recompile_per_token_count(monkeypatch):
    """The constexprs (the compile cache's key) are the same at 64 and 4096 tokens, persistent or not."""
    pytest.importorskip("triton")
    for config in (_cfg(128, 8, bn1=128, bn2=256, bk=64), _cfg(128, 8, pers=True, bn1=128, bn2=256, bk=64)):
        keys = []
        for tokens in (64, 4096):
            calls = _record(monkeypatch, None, config, num_tokens=tokens)
            keys.append([tuple(sorted(bind(fn, a, kw)[1].items())) for fn, _, a, kw in calls])
        assert keys[0] == keys[1]


@pytest.mark.parametrize(
    "block_n,n,gated,span",
    [
        (128, 2048, True, 1),  # DeepSeek-V3 w1: each half of a tile inside one 128-row scale group
        (64, 2048, True, 1),
        (256, 7168, False, 2),  # w2 256 wide: two groups
        (128, 320, True, 2),  # the up half starts at row 320, off the group grid
        (64, 320, True, 2),
        (64, 320, False, 1),  # w2 tiles start at multiples of block_n: on the grid whatever N is
        (256, 320, True, 3),
    ],
)
def test_weight_scale_span(block_n, n, gated, span):
    assert weight_scale_span(block_n, n, gated) == span


def _variants(shape, num_tokens, **device):
    """The tuner's candidates past the two it always offers first: the default config and the shipped entry (which
    may be TMA or Gluon configs themselves: the runtime runs those with the kernels the device has)."""
    from moe_fsm.kernels.triton_moe.tuning import candidate_configs, shipped_config

    always = {candidate_configs(shape, num_tokens)[0], shipped_config(shape, num_tokens)}
    return [c for c in candidate_configs(shape, num_tokens, **device) if c not in always]


def test_the_tuner_offers_tma_variants_only_on_a_tma_device_and_at_prefill():
    from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, candidate_configs

    shape = NAMED_SHAPES["deepseek-v3-fp8-block"]
    plain = candidate_configs(shape, 8192)
    with_tma = candidate_configs(shape, 8192, hopper=True)
    assert not any(c.hopper for c in _variants(shape, 8192))
    tma = [c for c in _variants(shape, 8192, hopper=True) if c.hopper]
    assert tma and with_tma[: len(plain)] == plain
    assert {c.block_m for c in tma} == {64, 128}
    assert any(c.w1.paired for c in tma) and any(c.gather_input for c in tma) and any(c.w1.flatten for c in tma)
    for config in tma:
        validate_config(config, block_fp8=True)
        assert config.w1.block_k == config.w2.block_k == 128
    # decode sizes take thin row blocks, which the TMA kernels cannot run
    assert not any(c.hopper for c in _variants(shape, 8, hopper=True))


def test_the_tuner_offers_gluon_variants_for_block_fp8_prefill_only():
    from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES

    block = NAMED_SHAPES["deepseek-v3-fp8-block"]
    gluon = [c for c in _variants(block, 8192, hopper=True, gluon=True) if c.gluon]
    assert gluon and not any(c.gluon for c in _variants(block, 8192, hopper=True))
    assert any(c.w1.persistent for c in gluon) and {c.block_m for c in gluon} == {64, 128}
    for config in gluon:
        validate_config(config, block_fp8=True)
    assert not any(c.gluon for c in _variants(block, 8, hopper=True, gluon=True))
    assert not any(c.gluon for c in _variants(NAMED_SHAPES["qwen3-30b-a3b"], 8192, hopper=True, gluon=True))


@pytest.mark.parametrize("make", [lambda: torch.zeros(64, 8).t(), lambda: torch.zeros(2, 4, 8),
                                  lambda: torch.zeros(4, 8, dtype=torch.int32)])
def test_the_sorted_quantizers_name_the_rows_they_take(make):
    """The Gluon path's input and intermediate quantizers read float [M, K] rows with unit stride along K:
    anything else is refused by name before any launch (the routing is not looked at)."""
    from moe_fsm.errors import KernelInputError
    from moe_fsm.kernels.triton_moe.hopper import quantize_real_rows, quantize_sorted

    with pytest.raises(KernelInputError, match=r"quantize_sorted takes float \[M, K\] rows contiguous along K"):
        quantize_sorted(make(), routing=None, slot_of_pair=None)
    with pytest.raises(KernelInputError, match=r"quantize_real_rows takes float \[M, K\] rows contiguous along K"):
        quantize_real_rows(make(), routing=None)
