"""Compile the engine's programs for a device this machine does not have, and read what a device would run.

The device compilers run without a device: libtpu gives compile-only TPU devices for a topology by name
(``jax.experimental.topologies.get_topology_desc("v5p:2x2x1", platform="tpu")``), and the CUDA plugin gives
compile-only NVIDIA GPUs from a ``GpuTargetConfigProto`` (``device_specs/*.txtpb``, written from the target
configs XLA publishes per GPU). ``jit(f).trace(abstract args sharded over those devices).lower(
lowering_platforms=...).compile()`` then runs XLA's own pipeline for that device (XLA:GPU with cuDNN fused
attention and ptxas, or the TPU compiler) and returns an executable with its ``memory_analysis()`` and
``as_text()``. Both need the ``aot`` extra (``pip install -e ".[aot]"``); on the CUDA side the plugin registers
only when JAX's own backend is the CPU (``JAX_PLATFORMS=cpu``, set by ``python -m infer plan``) or its CUDA
check is skipped.

What is traced is the program for that platform: ``platform.compiling_for`` makes every per-platform choice
(attention kernel, expert path, Gated DeltaNet form) take the device's branch, not this CPU's.

``plan_decode`` compiles the engine's prefill and decode loop for a pairing at a batch and context and reports
per device: weights, caches, temporaries and their total against the device's memory, the data-dependent loops
in one round (``while`` loops inside the round, read from the traced program), the fused kernels in the
compiled program, and the bytes of expert weights one round reads against the routed-only figure.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from importlib import resources
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from dflash_jax.errors import UserError

GIB = 2**30

# Device memory of the TPU kinds (HBM per chip, Google's published figures); GPUs read theirs from the spec.
TPU_KINDS = {"v5e": (16 * GIB, 2), "v5p": (95 * GIB, 3), "v6e": (32 * GIB, 2)}  # (memory, topology rank)
GPU_SPECS = {"h100": "h100.txtpb", "h200": "h200.txtpb", "b200": "b200.txtpb"}
DEVICES = ("cpu", "local") + tuple(GPU_SPECS) + tuple(TPU_KINDS)
AOT_HINT = 'install the aot extra (pip install -e ".[aot]")'


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """Where programs are compiled for: ``platform`` as the model code sees it (``cpu``, ``gpu``, ``tpu``),
    ``lowering`` as JAX names it (``cpu``, ``cuda``, ``tpu``), the (compile-only) devices, each one's memory."""

    name: str
    platform: str
    lowering: str
    devices: tuple
    memory_bytes: int | None


def gpu_target_config(name: str) -> str:
    """The ``GpuTargetConfigProto`` text of a GPU of ``GPU_SPECS`` (package data)."""
    return resources.files("dflash_jax").joinpath("device_specs", GPU_SPECS[name]).read_text()


def _gpu_memory(spec: str) -> int:
    found = re.search(r"device_memory_size:\s*(\d+)", spec)
    return int(found.group(1)) if found else None


def _tpu_topology(kind: str, count: int) -> str:
    """The smallest slice of ``kind`` with at least ``count`` chips (at least one host's 2x2)."""
    rank = TPU_KINDS[kind][1]
    dims = [2, 2] + [1] * (rank - 2)
    axis = 0
    while math.prod(dims) < count:
        dims[axis if rank == 2 else (axis + 2) % 3] *= 2
        axis = (axis + 1) % rank
    return f"{kind}:{'x'.join(map(str, sorted(dims) if rank == 2 else dims))}"


def compile_target(device: str, count: int = 1) -> CompileTarget:
    """``count`` devices to compile for: ``cpu`` (this machine's), a GPU of ``GPU_SPECS``, a TPU kind of
    ``TPU_KINDS``, or a TPU topology by name (``v5p:2x2x2``)."""
    if count < 1:
        raise UserError(f"need at least one device, got {count}")
    kind = device.split(":")[0]
    if device == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < count:
            raise UserError(f"--device cpu: a mesh of {count} devices, but this process has {len(devices)} CPU "
                            f"devices (--cpu-devices {count})")
        return CompileTarget("cpu", "cpu", "cpu", tuple(devices[:count]), None)
    if device == "local":  # the accelerators this process runs on (start JAX with their platform)
        devices = jax.local_devices()
        if len(devices) < count:
            raise UserError(f"--device local: a mesh of {count} devices, but this process has {len(devices)}")
        platform = devices[0].platform
        # bytes_limit: what JAX's allocator may take (on a GPU 75% of the card unless
        # XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise; an H200 showed 104.85 of 139.8 GiB), which is what fits.
        stats = devices[0].memory_stats() or {} if platform != "cpu" else {}
        lowering = {"gpu": "cuda"}.get(platform, platform)
        return CompileTarget(f"local {devices[0].device_kind}", platform, lowering, tuple(devices[:count]),
                             stats.get("bytes_limit"))
    if device not in DEVICES and not (kind in TPU_KINDS and ":" in device):
        raise UserError(f"unknown device {device!r} (choose from {', '.join(DEVICES)}, or a TPU topology such as "
                        "v5p:2x2x2)")
    from jax.experimental import topologies

    if jax.config.jax_compilation_cache_dir:
        # The persistent cache would store compile-only executables, but reading one back needs a client of
        # that device ("PjRtCompiler must be constructed with a Client"): the next plan would warn and compile
        # anyway. Off for this process (a plan compiles each program once).
        jax.config.update("jax_enable_compilation_cache", False)
    if kind in GPU_SPECS:
        spec = gpu_target_config(kind)
        try:
            topo = topologies.get_topology_desc("", platform="cuda", target_config=spec, topology=f"1x1x{count}")
        except Exception as e:  # no plugin, or registered too late (after JAX chose its backend)
            raise UserError(f"cannot compile for {device}: {_first_line(e)}; {AOT_HINT}, and start JAX with "
                            "JAX_PLATFORMS=cpu (python -m infer plan does)") from e
        return CompileTarget(device, "gpu", "cuda", tuple(topo.devices[:count]), _gpu_memory(spec))
    name = device if ":" in device else _tpu_topology(kind, count)
    # libtpu takes a machine-wide lock for the chips it drives; compile-only devices drive none, so two
    # processes (two planners, two test workers) may load it at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        topo = topologies.get_topology_desc(name, platform="tpu")
    except Exception as e:
        raise UserError(f"cannot compile for TPU topology {name!r}: {_first_line(e)}; {AOT_HINT}") from e
    if len(topo.devices) < count:
        raise UserError(f"TPU topology {name!r} has {len(topo.devices)} chips, the mesh needs {count}")
    return CompileTarget(name, "tpu", "tpu", tuple(topo.devices[:count]), TPU_KINDS[kind][0])


def _first_line(e: Exception) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(e).__name__


# ------------------------------------------------------------------------------------------ reading programs


def _sub_jaxprs(eqn) -> Iterator[Any]:
    for value in eqn.params.values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if hasattr(item, "eqns"):
                yield item
            elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield item.jaxpr


KERNEL_PRIMITIVES = ("pallas_call",)  # their loops run inside one kernel on the device: no host sync


def _eqns(jaxpr) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the programs nested in it, kernels' bodies excepted."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name not in KERNEL_PRIMITIVES:
            for sub in _sub_jaxprs(eqn):
                yield from _eqns(sub)


def _outer_loops(jaxpr) -> list:
    """The outermost ``while`` equations of a program (the decode loop's rounds)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            found.append(eqn)
        else:
            for sub in _sub_jaxprs(eqn):
                found.extend(_outer_loops(sub))
    return found


def loops_per_round(jaxpr) -> int:
    """Data-dependent loops inside one round of a decode-loop program: the ``while`` loops nested in its outer
    loop's body (a loop with a static trip count is a ``scan``, not counted). Each such loop checks its
    condition every trip; on a GPU that is a device-to-host sync per trip."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for loop in _outer_loops(jaxpr):
        body = loop.params["body_jaxpr"]
        total += sum(e.primitive.name == "while" for e in _eqns(getattr(body, "jaxpr", body)))
    return total


def while_loops(jaxpr) -> int:
    """Every ``while`` loop of a program (prefill: all of them run once per call)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return sum(e.primitive.name == "while" for e in _eqns(jaxpr))


# Custom calls of a compiled program that are fused kernels, by what they are.
FUSED_KERNELS = {"__cudnn$fmha": "cuDNN flash attention", "tpu_custom_call": "Pallas/Mosaic TPU kernel",
                 "__gpu$xla.gpu.triton": "Triton kernel", "mosaic_gpu": "Mosaic GPU kernel"}


def fused_kernels(hlo_text: str) -> dict[str, int]:
    """The fused kernels a compiled program calls, with their number of call sites."""
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo_text)
    found: dict[str, int] = {}
    for target in targets:
        for prefix, name in FUSED_KERNELS.items():
            if target.startswith(prefix):
                found[name] = found.get(name, 0) + 1
    return found


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded (abstract) arrays: the largest shard of each leaf (here, not
    in the trainer's plan, which reports the same figure for a train step: a decode plan needs no trainer)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        shard = leaf.sharding.shard_shape(shape) if getattr(leaf, "sharding", None) is not None else shape
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return int(total)


def abstract(tree: Any, shardings: Any) -> Any:
    """``tree``'s shapes and dtypes with ``shardings`` attached (arguments to ``jit(...).trace``)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# -------------------------------------------------------------------------------------------- decode plans


def plan_decode(target_config, draft_config=None, *, batch: int = 1, context: int = 4096,
                max_new_tokens: int = 256, dtype: Any = jnp.bfloat16, mesh: str | None = None,
                experts: str = "dequantize", attention: str = "auto", device: str = "cpu",
                block_size: int | None = None, tree_budget: int = 0, prefill_chunk: int | None = None, progress=None,
                keep_text: bool = False) -> dict:
    """Compile the engine's prefill and decode loop for ``device`` from abstract params (no weights) and
    report what one device holds and runs. ``context``: the positions a row holds at the end (its prompt is
    ``context - max_new_tokens`` tokens); ``mesh``: ``axis=size`` pairs (``tensor=8``); ``experts``: quantised
    expert weights (gpt-oss's MXFP4, the FP8 / INT4 of ``target_config.quantization``) ``packed`` (as
    ``--experts packed``) or decoded. ``draft_config`` None plans the
    autoregressive baseline; ``tree_budget``: rounds verify a draft tree of that many nodes (``--tree``);
    ``prefill_chunk``: the prefill's chunk width (None: the engine's default).
    ``keep_text`` adds the compiled programs' HLO text under ``_text``."""
    from dflash_jax import sharding
    from dflash_jax.checkpoints.expert_layouts import with_packed_experts
    from dflash_jax.checkpoints.hf_target import abstract_target_params
    from dflash_jax.checkpoints.official_draft import abstract_draft_params
    from dflash_jax.engine.generate import DecodeSettings, cache_slots, jitted_functions, prompt_width, verify_span
    from dflash_jax.engine.proposers import NoProposer, make_proposer
    from dflash_jax.models.experts import recording_reads, with_packed_layouts
    from dflash_jax.models.draft import shared_head
    from dflash_jax.platform import compiling_for
    from dflash_jax.precision import resolve_dtype

    dtype = resolve_dtype(dtype)
    say = progress or (lambda _: None)
    if batch < 1:
        raise UserError(f"batch must be >= 1, got {batch}")
    if not 1 <= max_new_tokens < context:
        raise UserError(f"context {context} must exceed max_new_tokens {max_new_tokens} (the prompt is the rest)")
    sizes = sharding.parse_mesh(mesh, _mesh_count(mesh))
    count = math.prod(sizes.values())
    target = compile_target(device, count)
    target_config = with_packed_experts(target_config, experts)
    if draft_config is not None:
        draft_config.validate_against(target_config)
    block = 1
    if draft_config is not None:  # the engine's block: a DSpark draft's block plus its anchor
        block = make_proposer(draft_config, block_size).block_size
    prompt = context - max_new_tokens
    if context > target_config.max_position_embeddings:
        raise UserError(f"context {context} exceeds the target's {target_config.max_position_embeddings} positions")
    width = prompt_width(prompt, max_new_tokens, target_config.max_position_embeddings)
    if tree_budget and draft_config is None:
        raise UserError("a tree budget needs a draft (not the baseline)")
    span_settings = DecodeSettings(max_new_tokens, tree_budget=tree_budget)
    slots = cache_slots(prompt, max_new_tokens, verify_span(span_settings, block), target_config.max_position_embeddings)
    the_mesh = sharding.make_mesh(sizes, devices=target.devices)
    rep = sharding.replicated(the_mesh)
    t_start = time.perf_counter()
    # Lowered under the mesh's abstract mesh: kernels that ask for the chip (Pallas's TPU lowering reads the
    # abstract mesh's device, else the default device: this CPU) get the device compiled for.
    with compiling_for(target.platform), jax.sharding.use_abstract_mesh(the_mesh.abstract_mesh), \
            recording_reads() as reads:
        tparams = abstract_target_params(target_config, dtype)
        tparams = with_packed_layouts(abstract(tparams, sharding.tree_shardings(tparams, the_mesh)), target.platform)
        chunk = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
        settings = DecodeSettings(max_new_tokens, mesh=the_mesh, attention=attention, tree_budget=tree_budget, **chunk)
        if draft_config is None:
            proposer, (consts, pstate) = NoProposer(), NoProposer().init()
        else:
            proposer = make_proposer(draft_config, block_size, dtype).on_mesh(the_mesh)
            # a DSpark draft's copies of the target's embedding and head are dropped where they equal the
            # target's (Decoder), as in every released draft: planned shared
            dparams = abstract_draft_params(draft_config, dtype, head_copies=False)
            dparams = abstract(dparams, sharding.tree_shardings(dparams, the_mesh))
            consts = {"params": dparams, "shared": shared_head(tparams, target_config.tie_word_embeddings)}
            pstate = jax.eval_shape(lambda: proposer.init(None, None, batch, slots)[1])
            pstate = abstract(pstate, jax.tree.map(lambda _: rep, pstate))
        batch_sharding = sharding.NamedSharding(the_mesh, sharding.spec_for((batch,), ("batch",), the_mesh))
        tokens = jax.ShapeDtypeStruct((batch, width), jnp.int32, sharding=sharding.NamedSharding(
            the_mesh, sharding.spec_for((batch, width), ("batch", None), the_mesh)))
        lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=batch_sharding)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)
        pre, _ = jitted_functions(target_config, proposer, settings, slots, dtype)
        say(f"compiling prefill for {target.name}")
        pre_traced = pre.trace(tparams, consts, pstate, tokens, lengths, key)
        pre_c = pre_traced.lower(lowering_platforms=(target.lowering,)).compile()
        state = abstract(jax.eval_shape(pre, tparams, consts, pstate, tokens, lengths, key), pre_c.output_shardings)
        _, loop = jitted_functions(target_config, proposer, settings, slots, dtype, pre_c.output_shardings)
        del reads[:]  # the prefill's expert calls: only the round's count below
        say(f"compiling the decode loop for {target.name}")
        loop_traced = loop.trace(tparams, consts, state, jax.ShapeDtypeStruct((), jnp.int32, sharding=rep))
        loop_c = loop_traced.lower(lowering_platforms=(target.lowering,)).compile()
    seconds = time.perf_counter() - t_start
    pre_mem, loop_mem = pre_c.memory_analysis(), loop_c.memory_analysis()
    weights = per_device_bytes(tparams) + (per_device_bytes(consts["params"]) if draft_config is not None else 0)
    caches = per_device_bytes((state.cache, state.proposer))
    other_state = per_device_bytes(state) - caches
    temps = max(int(pre_mem.temp_size_in_bytes), int(loop_mem.temp_size_in_bytes))
    total = weights + caches + other_state + temps
    texts = {"prefill": pre_c.as_text(), "decode": loop_c.as_text()}
    kernels = {name: fused_kernels(text) for name, text in texts.items()}
    read, routed, busiest = _expert_bytes(reads, the_mesh)
    gib = lambda n: round(n / GIB, 3)  # noqa: E731
    result = {
        "device": target.name,
        "platform": target.platform,
        "num_devices": count,
        "mesh": {a: int(s) for a, s in sizes.items()},
        "batch": batch, "context": context, "prompt_tokens": prompt, "max_new_tokens": max_new_tokens,
        "block_size": block, "tree_budget": tree_budget, "cache_slots": slots, "dtype": jnp.dtype(dtype).name, "experts": experts,
        "attention": attention,
        "weights_gib": gib(weights),
        "cache_gib": gib(caches),
        "other_state_gib": gib(other_state),
        "temporaries_gib": gib(temps),
        # which program needs them: the larger of the two is the figure above
        "prefill_temporaries_gib": gib(int(pre_mem.temp_size_in_bytes)),
        "decode_temporaries_gib": gib(int(loop_mem.temp_size_in_bytes)),
        # the prefill's inputs as the device lays them out (padded tiles included): above weights + caches
        # when the compiler's layouts pad them
        "prefill_arguments_gib": gib(int(pre_mem.argument_size_in_bytes)),
        "total_gib": gib(total),
        "device_memory_gib": gib(target.memory_bytes) if target.memory_bytes else None,
        "fits": (total <= target.memory_bytes) if target.memory_bytes else None,
        "programs_compiled": 2,
        "loops_per_round": loops_per_round(loop_traced.jaxpr),
        "prefill_loops": while_loops(pre_traced.jaxpr),
        "fused_kernels": kernels,
        "expert_gib_per_round": gib(read),
        "routed_expert_gib_per_round": gib(routed),
        "busiest_device_expert_gib_per_round": gib(busiest),  # an upper bound: all pairs on one device's experts
        "expert_bytes_per_round": int(read),  # exact, for programs too small for a GiB figure
        "routed_expert_bytes_per_round": int(routed),
        "compile_seconds": round(seconds, 1),
    }
    if keep_text:
        result["_text"] = texts
    return result


def _mesh_count(spec: str | None) -> int:
    """Devices a mesh spec names (its sizes multiplied; no spec: one device)."""
    if not spec:
        return 1
    total = 1
    for part in str(spec).split(","):
        _, _, value = part.partition("=")
        try:
            size = int(value)
        except ValueError:
            raise UserError(f"mesh {spec!r}: size {value!r} must be an integer") from None
        if size < 1:
            raise UserError(f"mesh {spec!r}: a plan needs every axis's size (no -1), got {value!r}")
        total *= size
    return total


def _expert_bytes(reads: list, mesh) -> tuple[int, int, int]:
    """Per device: the expert weight bytes one round's traced expert layers read (the mean over devices when
    the routed pairs spread evenly over the experts' shards), the bytes they would read touching only the
    experts their tokens are routed to (``experts.recording_reads``), and an upper bound for the busiest
    device: every pair routed to experts of one shard (at most the shard's ``E / expert`` experts for the
    grouped and dense paths, every pair for the routed one, which reads an expert per pair)."""
    experts_split = int(mesh.shape.get("expert", 1))
    rows_split = int(mesh.shape.get("tensor", 1))  # each expert's rows
    split = experts_split * rows_split
    read = sum(r.experts_read * r.bytes_per_expert for r in reads)
    routed = sum(min(r.routed_pairs, r.num_experts) * r.bytes_per_expert for r in reads)
    busiest = 0
    for r in reads:
        own = r.num_experts // experts_split if r.num_experts % experts_split == 0 else r.num_experts
        busiest += (r.experts_read if r.path == "routed" else min(r.experts_read, own)) * r.bytes_per_expert
    return read // split, routed // split, busiest // rows_split
