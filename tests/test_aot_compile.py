"""The engine compiled for an H200 and a TPU v5p on this CPU machine (``dflash_jax.aot``, the ``aot`` extra),
and what those programs hold: XLA:GPU through the CUDA plugin and the TPU compiler through libtpu, from
abstract parameters of tiny pairings (a dense Qwen3 target; a gpt-oss target with sliding windows, sinks and
32 experts, float and packed MXFP4), in bfloat16 as a user would run them.

Checked per device: no ``while`` loop inside a decode round (the traced program's outer loop body), the fused
attention kernel in the compiled program (cuDNN's ``__cudnn$fmha`` on the GPU, a Pallas ``tpu_custom_call`` on
the TPU), expert weight reads per round equal to the routed-only figure (a round of 8 tokens x top-2 = 16 of 32
experts), float32 logits, and ``python -m infer plan``'s JSON and errors. The counters are shown to fail where
they should: the CPU program's live-length loop counts one loop per layer. Skipped without the extra.
"""

import importlib.util
import json
import re

import jax.numpy as jnp
import pytest

from dflash_jax.aot import fused_kernels, loops_per_round, plan_decode
from dflash_jax.models.config import TargetConfig
from dflash_jax.models.draft_config import DraftConfig
from draft_tiny import official_config

HAVE_TPU = importlib.util.find_spec("libtpu") is not None
HAVE_CUDA = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None and \
    importlib.util.find_spec("nvidia.cuda_nvcc") is not None
needs = {"h200": pytest.mark.skipif(not HAVE_CUDA, reason="the aot extra (CUDA plugin) is not installed"),
         "v5p": pytest.mark.skipif(not HAVE_TPU, reason="the aot extra (libtpu) is not installed")}
DEVICES = [pytest.param(d, marks=needs[d]) for d in ("h200", "v5p")]

DENSE = dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
             max_position_embeddings=4096, tie_word_embeddings=False)
GPT_OSS = dict(model_type="gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
               max_position_embeddings=4096, num_local_experts=32, num_experts_per_tok=2, sliding_window=32,
               rope_theta=150000.0)


def pairing(fields: dict, block: int = 8):
    target = TargetConfig.from_dict(fields)
    draft = DraftConfig.from_dict(official_config(
        vocab_size=fields["vocab_size"], hidden_size=fields["hidden_size"], head_dim=64, num_attention_heads=4,
        num_key_value_heads=2, block_size=block, num_target_layers=fields["num_hidden_layers"],
        dflash_config={"target_layer_ids": [0, 2], "mask_token_id": fields["vocab_size"] - 1}))
    return target, draft


def plan(fields, device, **kw):
    target, draft = pairing(fields)
    return plan_decode(target, draft, batch=1, context=1024, max_new_tokens=64, dtype="bfloat16", device=device, **kw)


@pytest.fixture(scope="module")
def plans():
    return {}


def cached(plans, key, fields, device, **kw):
    if key not in plans:
        plans[key] = plan(fields, device, **kw)
    return plans[key]


@pytest.mark.parametrize("device", DEVICES)
def test_dense_pairing_compiles_with_fused_attention_and_no_loop_in_a_round(plans, device):
    p = cached(plans, ("dense", device), DENSE, device)
    assert p["loops_per_round"] == 0 and p["prefill_loops"] == 0
    kernel = {"h200": "cuDNN flash attention", "v5p": "Pallas/Mosaic TPU kernel"}[device]
    # 4 target layers and 2 draft layers attend through the kernel, in prefill and in every round
    assert p["fused_kernels"]["decode"].get(kernel, 0) >= 6 and p["fused_kernels"]["prefill"].get(kernel, 0) >= 4
    assert p["expert_gib_per_round"] == 0 and p["routed_expert_gib_per_round"] == 0
    # weights: the bfloat16 params of both models, exactly (target 4 layers + head; draft 2 layers + fc)
    assert 0 < p["weights_gib"] < p["total_gib"] < p["device_memory_gib"] and p["fits"]


@pytest.mark.parametrize("device", DEVICES)
def test_tree_rounds_compile_with_the_fused_kernel_and_no_loop(device):
    """Tree verification (``--tree``; gpt-oss: windows as rings, sinks, routed experts): the committed context
    still goes through the device's fused kernel (the tree block beside it as a masked XLA segment), with no
    data-dependent loop in a round, and the experts one round reads are the routed ones of its 25 tokens."""
    p = plan(GPT_OSS, device, tree_budget=24)
    assert p["tree_budget"] == 24 and p["loops_per_round"] == 0
    kernel = {"h200": "cuDNN flash attention", "v5p": "Pallas/Mosaic TPU kernel"}[device]
    assert p["fused_kernels"]["decode"].get(kernel, 0) >= 2
    assert 0 < p["expert_bytes_per_round"] <= 1.5 * p["routed_expert_bytes_per_round"]


# Every GPU case; the TPU (a slower compile here) with packed experts, which exercise the routed float path's
# gather too (decoded rows) and the TPU-specific hoisting barrier.
GPT_OSS_CASES = [pytest.param(d, m, marks=needs[d]) for d, m in
                 (("h200", "dequantize"), ("h200", "packed"), ("v5p", "packed"))]


@pytest.mark.parametrize("device,mxfp4", GPT_OSS_CASES)
def test_gpt_oss_round_reads_only_routed_experts_and_runs_no_loop(plans, device, mxfp4):
    """Windows (a bounded span), sinks (folded after the fused kernel) and experts (routed: 8 tokens x top-2
    of 32) compile with no loop in a round; the experts one round reads are exactly the routed ones."""
    p = cached(plans, ("gpt_oss", device, mxfp4), GPT_OSS, device, experts=mxfp4, keep_text=True)
    assert p["loops_per_round"] == 0
    assert p["routed_expert_bytes_per_round"] > 0
    assert p["expert_bytes_per_round"] <= 1.5 * p["routed_expert_bytes_per_round"]
    if device == "h200":  # the full (unwindowed) layers take cuDNN even with sinks
        assert p["fused_kernels"]["decode"].get("cuDNN flash attention", 0) >= 2


@pytest.mark.parametrize("device", DEVICES[:1])
def test_compiled_gpu_programs_have_no_all_expert_broadcast(plans, device):
    """On the H200 no tensor spans all 32 experts and the routed rows at once (the dense ``ragged_dot``
    expansion, ``bf16[32, rows, 64]``, that made every token multiply every expert): the decode round reads
    only the routed experts, the prefill's grouped matmuls run this project's Triton kernel (4 layers x 3
    projections). The control: plain ``ragged_dot`` compiled for the same GPU holds the expansion."""
    import jax

    from dflash_jax.aot import compile_target

    # the decoded-experts plan of test_gpt_oss_round_reads_only_routed_experts_and_runs_no_loop (one compile)
    p = cached(plans, ("gpt_oss", device, "dequantize"), GPT_OSS, device, experts="dequantize", keep_text=True)

    def expanded(text):  # [32 experts, rows, 64]: rows other than 64 (the weights' own [E, H, I], H = I = 64)
        return {int(rows) for rows in re.findall(r"bf16\[32,(\d+),64\]", text)} - {64}

    assert not expanded(p["_text"]["decode"]) and not expanded(p["_text"]["prefill"])
    assert fused_kernels(p["_text"]["prefill"]).get("Triton kernel") == 12
    gpu = compile_target(device)
    one = jax.sharding.NamedSharding(jax.sharding.Mesh(gpu.devices[:1], ("x",)), jax.sharding.PartitionSpec())
    rows = jax.ShapeDtypeStruct((2048, 64), jnp.bfloat16, sharding=one)
    stack = jax.ShapeDtypeStruct((32, 64, 64), jnp.bfloat16, sharding=one)
    sizes = jax.ShapeDtypeStruct((32,), jnp.int32, sharding=one)
    plain = jax.jit(jax.lax.ragged_dot).trace(rows, stack, sizes).lower(
        lowering_platforms=(gpu.lowering,)).compile().as_text()
    assert expanded(plain)


@pytest.mark.parametrize("device", DEVICES[:1])
def test_expert_mesh_prefill_runs_each_devices_own_experts(device):
    """gpt-oss's 32 experts split 4 ways (``--mesh expert=4``) on the H200: the prefill's grouped matmuls run
    inside the shard_map over ``expert`` on each device's 8 experts (the Triton kernel's weight operand
    ``bf16[8, 64, 64]``), and nothing gathers a layer's 32 experts onto a device (no all-gather producing
    ``[32, 64, 64]``; before the shard_map, which has no partitioning rule for the kernel, XLA all-gathered
    every layer's three stacks before its kernels: checked on that code, this test failed)."""
    p = plan(GPT_OSS, device, experts="dequantize", mesh="expert=4", keep_text=True)
    prefill = p["_text"]["prefill"]
    gathered = [line for line in prefill.splitlines() if "all-gather" in line and "bf16[32,64,64]" in line]
    assert not gathered, gathered[0][:200]
    assert fused_kernels(prefill).get("Triton kernel") == 12
    assert re.search(r"bf16\[8,64,64\]", prefill)


@pytest.mark.parametrize("device", DEVICES[:1])
def test_tensor_mesh_prefill_runs_each_devices_own_intermediate_units(device):
    """The same experts split over ``expert=2,tensor=2``: each device's grouped matmuls read its 16 experts'
    own halves of the intermediate units (gate/up ``bf16[16,64,32]``, down ``bf16[16,32,64]``), and no
    all-gather feeds a grouped matmul. (With ``tensor`` left to XLA, which has no partitioning rule for the
    kernel, every layer's kernels read all-gathered ``bf16[32,64,32]`` stacks: checked on that code, this test
    failed.)"""
    p = plan(GPT_OSS, device, experts="dequantize", mesh="expert=2,tensor=2", keep_text=True)
    prefill = p["_text"]["prefill"]
    gathered = [line for line in prefill.splitlines() if "all-gather" in line and "grouped_matmul" in line]
    assert not gathered, gathered[0][:200]
    assert fused_kernels(prefill).get("Triton kernel") == 12
    assert re.search(r"bf16\[16,64,32\]", prefill) and re.search(r"bf16\[16,32,64\]", prefill)


@needs["h200"]
def test_packed_experts_enter_the_prefill_chunk_loop_as_stored():
    """A prefill of several chunks (a loop over them) with packed MXFP4 experts: the blocks reach the loop in
    their stored (row-major) layout. Unpinned, XLA:GPU gives them the layout the decode reads best and makes
    that copy of every layer's experts once before the loop, alive through it (gpt-oss-120b at 8k: 61.9 GiB
    of temporaries against 3.2 pinned; ``experts.PIN_PACKED_LAYOUT``)."""
    p = plan(GPT_OSS, "h200", experts="packed", prefill_chunk=256, keep_text=True)
    text = p["_text"]["prefill"]
    blocks = re.findall(r"u8\[32,\d+,2,16\]\{([\d,]+)\}", text)
    assert blocks and re.search(r"= \(.*\) while\(", text)
    assert set(blocks) == {"3,2,1,0"}, sorted(set(blocks))


@needs["v5p"]
def test_tpu_decode_loop_takes_packed_experts_as_stored(monkeypatch):
    """128 packed experts (as gpt-oss-120b): the TPU's default layout for ``u8[128, out, in/32, 16]`` puts the
    experts minor, and the decode loop then copies every layer's blocks into the output-rows-minor order in
    device memory (copies into on-chip memory, ``S(1)``, are the kernels' own and stay). With the blocks and
    scales stored in that order (``experts.PACKED_LAYOUTS``, as the loader places them, and pinned in it after
    each layer's barrier) no such copy is left. The control without the table must show the copies. (What the
    pin adds shows only in deep stacks: gpt-oss-120b's 16-layer cut, 38.1 -> 4.9 GiB, measured when the pin was added.)"""
    from dflash_jax.models import experts

    fields = dict(GPT_OSS, num_local_experts=128)

    def hbm_copies():
        text = plan(fields, "v5p", experts="packed", keep_text=True)["_text"]["decode"]
        entry = set(re.findall(r"proj_blocks__\S* = u8\[128,\d+,2,16\]\{([\d,]+):[^}]*\} parameter", text))
        copies = re.findall(r"= u8\[128,\d+,2,16\]\{([^}]*)\} copy\(", text)
        return entry, [c for c in copies if "S(" not in c]

    entry, copies = hbm_copies()
    assert entry == {"1,3,2,0"} and not copies, (entry, copies)
    monkeypatch.setitem(experts.PACKED_LAYOUTS, "tpu", {})
    entry, copies = hbm_copies()
    assert entry == {"0,3,2,1"} and copies, (entry, copies)


def test_cpu_program_counts_its_live_length_loops():
    """The counter can fail: on the CPU the default attention walks the live length in a loop per layer
    (4 target layers + 2 draft layers), and ``--attention xla`` removes them."""
    target, draft = pairing(DENSE)
    looped = plan_decode(target, draft, context=1024, max_new_tokens=64, dtype="float32", device="cpu")
    static = plan_decode(target, draft, context=1024, max_new_tokens=64, dtype="float32", device="cpu",
                         attention="xla")
    assert looped["loops_per_round"] == 6 and static["loops_per_round"] == 0
    assert looped["fits"] is None and looped["device_memory_gib"] is None


def test_loops_per_round_reads_nested_while_loops():
    import jax

    def program(n):
        def round_(c):
            inner = jax.lax.fori_loop(0, c[0], lambda i, x: x + 1, 0)  # a traced trip count: a while
            fixed = jax.lax.fori_loop(0, 3, lambda i, x: x + 1, 0)  # a static one: a scan
            return c[0] + 1, c[1] + inner + fixed

        return jax.lax.while_loop(lambda c: c[0] < n, round_, (0, 0))

    assert loops_per_round(jax.make_jaxpr(program)(5)) == 1


@pytest.mark.parametrize("device", DEVICES[1:])
def test_infer_plan_cli_json_and_errors(device, capsys, tmp_path):
    from infer.plan import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(DENSE))
    assert main(["--target-config", str(cfg), "--device", device, "--context", "512", "--max-new-tokens", "32",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("weights_gib", "cache_gib", "temporaries_gib", "total_gib", "device_memory_gib", "loops_per_round",
                "expert_gib_per_round", "routed_expert_gib_per_round", "busiest_device_expert_gib_per_round"):
        assert key in out
    assert out["temporaries_gib"] == max(out["prefill_temporaries_gib"], out["decode_temporaries_gib"])
    assert out["block_size"] == 1 and out["loops_per_round"] == 0  # the autoregressive baseline
    assert main(["--target-config", str(cfg), "--device", "v9x"]) == 2
    assert "unknown device 'v9x'" in capsys.readouterr().err
    assert main(["--target-config", str(cfg), "--device", device, "--context", "16", "--max-new-tokens", "32"]) == 2
    assert "context 16 must exceed max_new_tokens 32" in capsys.readouterr().err
    assert main(["--target-config", str(cfg), "--mesh", "tensor=-1"]) == 2
    assert "no -1" in capsys.readouterr().err


def test_logits_are_float32_in_bfloat16():
    """Decisions in float32: the target's and the draft's logits leave the head in float32 whatever the
    compute dtype (a bfloat16 argmax flips near-ties)."""
    import jax

    from dflash_jax.checkpoints.hf_target import abstract_target_params
    from dflash_jax.models.draft import SharedHead, head_logits
    from dflash_jax.models.target import TargetModel

    target, _ = pairing(DENSE)
    params = abstract_target_params(target, jnp.bfloat16)
    tokens = jnp.zeros((1, 3), jnp.int32)
    out = jax.eval_shape(lambda p: TargetModel(target, jnp.bfloat16).apply({"params": p}, tokens, tokens), params)
    assert out.logits.dtype == jnp.float32
    shared = SharedHead(jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((64, 256), jnp.bfloat16))
    assert jax.eval_shape(head_logits, shared, jnp.zeros((1, 2, 64), jnp.bfloat16)).dtype == jnp.float32
