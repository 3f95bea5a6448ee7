"""Memory and FLOPs of the train step before any weight exists: compile it ahead of time from abstract shapes.

``plan_step`` builds the target params and the draft ``TrainState`` as ``jax.ShapeDtypeStruct`` trees (no
allocation, so the 8B pairing plans on a laptop), gives them the shardings of ``dflash_jax.sharding`` exactly
as the trainer does, jits ``make_train_step`` with the trainer's ``in_shardings``/``out_shardings`` and donation,
lowers and compiles it, and reads XLA's own accounting of the compiled per-device program:

* ``compiled.memory_analysis()``: per-device bytes of the arguments, the outputs, the temporaries of the
  buffer assignment, and the bytes by which outputs alias donated arguments (the new train state reuses the
  old one's buffers). ``total = arguments + outputs + temporaries - aliased`` is what one device must hold at
  the step's peak by that accounting. jit drops arguments the step never reads (target layers past the
  last feature layer); the trainer holds them anyway, so ``resident_total_bytes`` adds them back;
* ``compiled.cost_analysis()``: the FLOPs and bytes accessed of the per-device program (a compile-only GPU
  reports none: XLA's same analysis of its optimised module then, run by the CPU client). XLA counts a while
  loop's body once, whatever its trip count, so this undercounts the step's scans over anchor chunks and
  accumulation micro-steps; ``matmul_flops`` counts the matrix products of the step's jaxpr with every
  ``scan`` multiplied by its length.

``time_and_cost`` turns a plan into a roofline step time for a device with known peak rates
(``device_specs/peak_rates.txtpb``): XLA's FLOPs and bytes with the loop iterations it leaves out added back,
against peak bf16 FLOP/s and HBM bandwidth, whichever is slower; then tokens/s per chip and a run's wall time
and chip-hours. A lower bound: no communication, no overlap losses.

The figures are the compiling backend's: on CPU (``--xla_force_host_platform_device_count``) they are
XLA:CPU's buffer assignment, a proxy for an accelerator's, not a measurement of one. Given a
``dflash_jax.aot.CompileTarget`` (``compile_devices``: compile-only H100/H200/B200 or TPU devices, no device
needed), ``plan_step`` compiles with that device's own compiler instead, and the figures are its buffer
assignment for that device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from importlib import resources
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex_core
from jax.sharding import Mesh

from dflash_jax import sharding
from dflash_jax.aot import compile_target, fused_kernels, per_device_bytes
from dflash_jax.checkpoints.hf_target import abstract_target_params
from dflash_jax.checkpoints.official_draft import abstract_draft_params
from dflash_jax.errors import UserError
from dflash_jax.models.config import TargetConfig
from dflash_jax.models.draft import DraftModel
from dflash_jax.models.draft_config import DraftConfig
from dflash_jax.models.experts import with_packed_layouts
from dflash_jax.models.target import TargetModel
from dflash_jax.platform import compiling_for
from dflash_jax.training.checkpointing import abstract_like
from dflash_jax.training.step import StepConfig, init_train_state, make_train_step


def abstract_batch(global_batch: int, seq_len: int, mesh: Mesh) -> tuple[dict, dict]:
    """The batch the trainer feeds (tokens/loss_mask ``[G, L]``, lengths ``[G]``) and its shardings."""
    shapes = {"tokens": ((global_batch, seq_len), jnp.int32), "loss_mask": ((global_batch, seq_len), jnp.bool_),
              "lengths": ((global_batch,), jnp.int32)}
    shardings = {k: sharding.batch_sharding(mesh, len(shape)) for k, (shape, _) in shapes.items()}
    batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[k]) for k, (shape, dtype) in shapes.items()}
    return batch, shardings


def xla_cost(compiled: Any) -> dict | None:
    """FLOPs and bytes accessed of the compiled per-device program, as XLA's ``HloCostAnalysis`` counts them
    (each loop body once, whatever its trip count): ``{"flops", "bytes", "source"}`` or None.

    ``source`` is ``compiler`` where the device's compiler reports them (``compiled.cost_analysis()``: CPU, and
    TPUs without a device), else ``hlo``: the same analysis run by this process's CPU client over the device's
    optimised program (a compile-only GPU reports none of its own). In the ``hlo`` figures a library call
    (cuBLAS, cuDNN) counts its operand and result bytes but may count no FLOPs; ``matmul_flops`` bounds those."""
    cost = None
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        pass
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    source = "compiler"
    if not isinstance(cost, dict) or cost.get("flops") is None:
        source, cost = "hlo", _hlo_cost(compiled)
    if not cost or cost.get("flops") is None or float(cost["flops"]) < 0:
        return None
    return {"flops": float(cost["flops"]), "bytes": float(cost.get("bytes accessed") or 0.0), "source": source}


def _hlo_cost(compiled: Any) -> dict | None:
    """XLA's cost analysis of ``compiled``'s optimised module, by the CPU client (private APIs: None where this
    jaxlib moved them)."""
    try:
        from jax._src.lib import xla_client

        module = compiled.runtime_executable().hlo_modules()[0]
        return dict(xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))
    except Exception:
        return None


def program_cost(jaxpr: Any, compiled: Any) -> dict:
    """What a plan reports of a program's work: XLA's per-device ``flops``, ``bytes_accessed`` and their
    ``cost_source`` (None where none is reported), and the jaxpr's ``matmul_flops`` of the whole program with
    loops at their trip counts, ``matmul_flops_loops_once`` with each loop body once, ``matmul_flops_exact``."""
    cost = xla_cost(compiled)
    flops, exact = matmul_flops(jaxpr)
    return {"flops": cost["flops"] if cost else None, "bytes_accessed": cost["bytes"] if cost else None,
            "cost_source": cost["source"] if cost else None, "matmul_flops": flops,
            "matmul_flops_loops_once": matmul_flops(jaxpr, multiply_loops=False)[0], "matmul_flops_exact": exact}


def _sub_jaxprs(value: Any):
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def matmul_flops(jaxpr: Any, multiply_loops: bool = True) -> tuple[int, bool]:
    """FLOPs of every ``dot_general`` of a (closed) jaxpr, loops multiplied by their trip counts: ``scan``
    bodies count ``length`` times, a ``cond`` its dearest branch. Returns ``(flops, exact)``; ``exact`` is
    False when a ``while`` loop (trip count unknown here) was counted once. Matrix products are nearly all of
    a transformer's FLOPs; elementwise work is left out. ``multiply_loops=False`` counts every loop body once,
    as XLA's cost analysis does: the difference of the two is what that analysis leaves out."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total, exact = 0, True
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, _), (lb, _) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            shared = math.prod(lhs[d] for d in (*lc, *lb))
            total += 2 * math.prod(lhs) * math.prod(rhs) // max(shared, 1)
            continue
        counted = [matmul_flops(j, multiply_loops) for v in eqn.params.values() for j in _sub_jaxprs(v)]
        if not counted:
            continue
        flops = [f for f, _ in counted]
        exact = exact and all(e for _, e in counted) and name != "while"
        if name == "cond":
            total += max(flops)
        elif name == "scan":
            total += (eqn.params["length"] if multiply_loops else 1) * sum(flops)
        else:  # pjit, remat, custom_jvp/vjp calls, shard_map: once (a while loop: at least once)
            total += sum(flops)
    return total, exact


def _topology_chips(device: str) -> int | None:
    """Chips a TPU topology name gives (``v5p:2x2x2`` -> 8); None for a bare device name or a malformed one
    (``compile_target`` then says what is wrong with it)."""
    _, sep, dims = device.partition(":")
    if not sep:
        return None
    try:
        sizes = [int(d) for d in dims.lower().split("x")]
    except ValueError:
        return None
    return math.prod(sizes) if sizes and all(d > 0 for d in sizes) else None


def compile_devices(spec: Any, device: str):
    """The mesh sizes and the ``aot.CompileTarget`` of compile-only ``device`` devices for mesh ``spec``.

    Nothing here has the devices, so their number comes from the mesh: the product of its sizes. A TPU
    topology (``v5p:2x2x2``) is a slice the trainer would run on whole, so the mesh must cover its chips (as
    ``train fit`` needs the mesh to cover ``jax.devices()``), and a ``-1`` axis (a run config's default
    ``data: -1``) takes the rest of them; on a bare device name (``h200``, ``v5p``) a ``-1`` axis is 1, the
    smallest mesh with the fixed axes, and no spec at all is one device. ``local`` (this process's own
    devices) is the exception: they exist, so the mesh covers them as ``train fit``'s does."""
    chips = _topology_chips(device)
    if device == "local":  # real devices: the mesh covers them all, as 'train fit' makes it
        sizes = sharding.parse_mesh(spec, len(jax.local_devices()))
    elif chips is not None:
        try:
            sizes = sharding.parse_mesh(spec, chips)
        except UserError as e:  # say where the "available" devices come from
            raise UserError(f"TPU topology {device!r} has {chips} chips: {e}") from None
    elif not spec:
        sizes = sharding.parse_mesh(None, 1)
    else:
        sizes = sharding.parse_mesh(spec, _fixed_product(spec))
    target = compile_target(device, math.prod(sizes.values()))
    return sizes, target


def _fixed_product(spec: Any) -> int:
    """Devices a mesh spec names with its ``-1`` axes taken as 1 (malformed specs: parse_mesh's errors)."""
    items = spec.items() if not isinstance(spec, str) else (p.partition("=")[::2] for p in spec.split(","))
    total = 1
    for _, value in items:
        try:
            size = int(value)
        except (TypeError, ValueError):
            return 1  # parse_mesh names the bad size
        total *= size if size > 0 else 1
    return total


def unused_inputs(jaxpr: Any) -> list[bool] | None:
    """Per input of a (closed) jaxpr: whether jit drops it, the step never reading it. This is the dead-code
    pass jit itself runs before compiling (``pe.dce_jaxpr``, which looks inside scans, remat and inner calls);
    JAX exports no public form of it, so None where this JAX has none (the caller then falls back)."""
    try:
        from jax._src.interpreters import partial_eval as pe

        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        _, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    except Exception:  # a private API: moved or changed
        return None
    return [not u for u in used]


def plan_step(target_config: TargetConfig, draft_config: DraftConfig, step_cfg: StepConfig, mesh: Mesh,
              global_batch: int, seq_len: int, dtype: Any, optimizer: optax.GradientTransformation,
              schedule: Any = None, target: Any = None) -> dict:
    """AOT-compile the train step for ``mesh`` from abstract shapes; per-device bytes, FLOPs, compile time.

    Returns a dict of plain numbers, bytes per device: ``argument_bytes``, ``output_bytes``, ``temp_bytes``,
    ``alias_bytes`` and ``total_bytes`` (arguments + outputs + temporaries - aliased) from XLA;
    ``input_bytes`` (everything the trainer passes: state, target params, batch), ``dropped_argument_bytes``
    (inputs that jit drops because the step never reads them, still resident in the trainer) and
    ``resident_total_bytes`` (``total_bytes`` + dropped: what must fit); ``peak_bytes`` (the backend's own
    figure, ``None`` when not reported); ``target_param_bytes``, ``draft_param_bytes`` and
    ``draft_state_bytes`` (params, Adam moments, step and key). FLOPs: ``flops`` and ``bytes_accessed`` (XLA's
    cost analysis of the per-device program, ``None`` when not reported, ``cost_source`` saying whose; it
    counts each loop body ONCE, so it undercounts the anchor-chunk and accumulation loops) and
    ``matmul_flops`` (every matrix product of the global step, loops multiplied by their trip counts;
    ``matmul_flops_exact``; ``matmul_flops_loops_once``: each loop body once, as XLA counts). Also ``lower_seconds``,
    ``compile_seconds``, and the ``mesh``, ``num_devices`` and ``backend`` planned for.

    ``target`` (a ``dflash_jax.aot.CompileTarget``, ``mesh`` built over its devices): compile for that device
    instead of this process's backend; then ``backend`` is its platform (``gpu``, ``tpu``), and ``device``,
    ``device_memory_bytes`` (None when unknown) and ``fused_kernels`` (of the compiled program) are added.
    """
    num_shards = int(np.prod([mesh.shape[a] for a in sharding.LOGICAL_TO_MESH["batch"]]))
    if global_batch % num_shards:
        raise UserError(f"global batch {global_batch} is not divisible by data x fsdp = {num_shards} "
                         f"(the batch is sharded over both axes)")
    if global_batch % step_cfg.accum_steps:
        raise UserError(f"global batch {global_batch} is not divisible by accum_steps {step_cfg.accum_steps}")
    target_abstract = abstract_target_params(target_config, dtype)
    draft_abstract = abstract_draft_params(draft_config, jnp.float32, head_copies=False)  # DSpark: trained without
    if target is None:
        context, lowering = jax.set_mesh(mesh), {}
    else:
        # Traced as dflash_jax.aot.plan_decode traces for a device: under the abstract mesh, which is all the
        # step's sharding constraints read and where a kernel that asks for the chip finds the device compiled
        # for (not this CPU); compiling_for makes every per-platform choice (expert path, attention kernel,
        # Gated DeltaNet form) the device's.
        context = _device_context(mesh, target.platform)
        lowering = {"lowering_platforms": (target.lowering,)}
    with context:
        state_abstract = jax.eval_shape(lambda p: init_train_state(p, optimizer, 0), draft_abstract)
        state_sh = sharding.tree_shardings(state_abstract, mesh)
        target_sh = sharding.tree_shardings(target_abstract, mesh)
        state_arg = abstract_like(state_abstract, state_sh)
        target_arg = with_packed_layouts(abstract_like(target_abstract, target_sh),
                                         jax.default_backend() if target is None else target.platform)
        batch_arg, batch_sh = abstract_batch(global_batch, seq_len, mesh)

        step_fn = make_train_step(TargetModel(target_config, dtype), DraftModel(draft_config, dtype), step_cfg,
                                  optimizer, schedule)
        train_step = jax.jit(step_fn, in_shardings=(state_sh, target_sh, batch_sh),
                             out_shardings=(state_sh, sharding.replicated(mesh)), donate_argnums=(0,))
        t0 = time.perf_counter()
        traced = train_step.trace(state_arg, target_arg, batch_arg)
        lowered = traced.lower(**lowering)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()

    mem = compiled.memory_analysis()
    args, outs = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
    temps, alias = int(mem.temp_size_in_bytes), int(mem.alias_size_in_bytes)
    peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0) or None
    total = args + outs + temps - alias
    # jit drops arguments the step never reads (the target's layers past its last feature layer, its final
    # norm); the trainer still holds them on the device, so they count towards what must fit. They are found
    # in the traced program, not as inputs minus XLA's argument bytes: a TPU pads every array to its tiles,
    # so its argument bytes exceed the inputs' own and that difference would hide the dropped ones.
    flat_args = jax.tree.leaves((state_arg, target_arg, batch_arg))
    inputs = per_device_bytes(flat_args)
    unused = unused_inputs(traced.jaxpr)
    if unused is not None and len(unused) == len(flat_args):
        dropped = per_device_bytes([a for a, u in zip(flat_args, unused) if u])
    else:
        dropped = max(0, inputs - args)  # exact where arrays are not padded (CPU, GPU)
    extra = {}
    if target is not None:
        extra = {"device": target.name, "device_memory_bytes": target.memory_bytes,
                 "fused_kernels": fused_kernels(compiled.as_text())}
    return {
        "mesh": {a: int(mesh.shape[a]) for a in sharding.MESH_AXES},
        "num_devices": int(mesh.devices.size),
        "backend": jax.default_backend() if target is None else target.platform,
        **extra,
        "argument_bytes": args,
        "output_bytes": outs,
        "temp_bytes": temps,
        "alias_bytes": alias,
        "total_bytes": total,
        "input_bytes": inputs,
        "dropped_argument_bytes": dropped,
        "resident_total_bytes": total + dropped,
        "peak_bytes": peak,
        "target_param_bytes": per_device_bytes(target_arg),
        "draft_param_bytes": per_device_bytes(state_arg.params),
        "draft_state_bytes": per_device_bytes(state_arg),
        **program_cost(traced.jaxpr, compiled),
        "lower_seconds": t1 - t0,
        "compile_seconds": t2 - t1,
    }


@contextlib.contextmanager
def _device_context(mesh: Mesh, platform: str) -> Iterator[None]:
    with compiling_for(platform), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        yield


# ------------------------------------------------------------------------------------------ time and cost

PEAK_RATES_FILE = "peak_rates.txtpb"
# Rows of a run config's data when its count is not given (--rows): the DFlash paper's Qwen3-8B training set,
# about 800K regenerated samples (docs/ablations.md); a stated assumption, printed with the figures.
ASSUMED_ROWS = 800_000
SECONDS_PER_HOUR = 3600.0


@dataclasses.dataclass(frozen=True)
class PeakRates:
    """One chip's peak rates: dense bfloat16 matrix FLOP/s and HBM bytes/s, and where each figure is from."""

    device: str
    flops_per_s: float
    bytes_per_s: float
    bandwidth_source: str


def _spec_blocks(text: str) -> dict[str, dict[str, str]]:
    """``device { name: "x" key: value ... }`` blocks of the peak-rates file, by name (comments dropped)."""
    text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    blocks = {}
    for body in re.findall(r"device\s*\{([^}]*)\}", text):
        fields = dict(re.findall(r"(\w+)\s*:\s*\"?([^\s\"]+)\"?", body))
        blocks[fields["name"]] = fields
    return blocks


def peak_rates(device: str) -> PeakRates:
    """The peak rates of one chip of ``device`` (``h200``, ``v5p``, a topology ``v5p:2x2x2``), from
    ``device_specs/peak_rates.txtpb``; a GPU's HBM bandwidth from its own target config when the file gives
    none. A device with no figures (``cpu``, ``local``, an unknown name) is a ``UserError``."""
    from dflash_jax.aot import GPU_SPECS, gpu_target_config

    kind = device.split(":")[0]
    blocks = _spec_blocks(resources.files("dflash_jax").joinpath("device_specs", PEAK_RATES_FILE).read_text())
    if kind not in blocks:
        raise UserError(f"no peak rates for device {device!r}: the roofline time needs one of "
                        f"{', '.join(sorted(blocks))} (dflash_jax/device_specs/{PEAK_RATES_FILE})")
    fields = blocks[kind]
    if "hbm_bytes_per_s" in fields:
        bandwidth, source = float(fields["hbm_bytes_per_s"]), PEAK_RATES_FILE
    else:
        found = re.search(r"memory_bandwidth:\s*(\d+)", gpu_target_config(kind)) if kind in GPU_SPECS else None
        if found is None:
            raise UserError(f"no HBM bandwidth for device {device!r} in dflash_jax/device_specs/")
        bandwidth, source = float(found.group(1)), GPU_SPECS[kind]
    return PeakRates(kind, float(fields["bf16_flops_per_s"]), bandwidth, source)


def roofline(flops_per_device: float, bytes_per_device: float, rates: PeakRates) -> dict:
    """The roofline time of one step on one device: the larger of its FLOPs at peak FLOP/s (``compute_s``)
    and its bytes at peak HBM bandwidth (``memory_s``), ``bound`` naming which. Devices run the step in
    parallel, so this is the step's time; a lower bound (no communication, no overlap losses)."""
    compute_s = flops_per_device / rates.flops_per_s
    memory_s = bytes_per_device / rates.bytes_per_s
    return {"compute_s": compute_s, "memory_s": memory_s, "step_s": max(compute_s, memory_s),
            "bound": "compute" if compute_s >= memory_s else "memory"}


def step_cost(plan: dict) -> dict:
    """Per-device FLOPs and bytes of one step from a ``plan_step`` result, loops counted at their trip counts.

    XLA's cost analysis counts each loop body once; the matrix products of the iterations it leaves out (the
    jaxpr's count with loops multiplied, less the count with each body once, split evenly over the devices)
    are added to its FLOPs, and its bytes are scaled by the same factor (the loops' iterations taken to move
    as many bytes per FLOP as the rest of the step). This takes every loop of the jaxpr to survive into the
    compiled program, as the train step's do (its loss, computed in the forward pass's loops, is an output);
    a loop XLA removed as dead would be counted all the same. The FLOPs are at least the jaxpr's matrix
    products split evenly over the devices. Without XLA's figures: those alone, no bytes. ``source`` says
    which."""
    devices = plan["num_devices"]
    missed = max(0, plan["matmul_flops"] - plan["matmul_flops_loops_once"]) / devices
    if plan.get("flops") is None:
        return {"flops": plan["matmul_flops"] / devices, "bytes": 0.0, "loop_flops": missed,
                "source": "jaxpr matmuls (no cost analysis)"}
    counted = plan["flops"] + missed
    scale = counted / plan["flops"] if plan["flops"] > 0 else 1.0
    # At least the jaxpr's matrix products: a GPU program's cuBLAS and cuDNN calls are custom calls, whose
    # FLOPs XLA's analysis of the optimised module does not count.
    floor = plan["matmul_flops"] / devices
    source = f"XLA cost analysis ({plan['cost_source']}) + loop iterations"
    if floor > counted:
        source = f"jaxpr matmuls, more than {source}"
    return {"flops": max(counted, floor), "bytes": (plan["bytes_accessed"] or 0.0) * scale, "loop_flops": missed,
            "source": source}


def run_steps(global_batch: int, epochs: int, rows: int | None, max_steps: int | None) -> int:
    """Optimizer steps of a run, as ``train fit`` counts them: ``epochs x rows // global_batch`` (the last
    partial batch dropped), capped by ``max_steps``; ``max_steps`` alone when the rows are not known."""
    if rows is None:
        if not max_steps:
            raise UserError("the run's steps need its row count (--rows N) or train.max_steps")
        return max_steps
    if rows < 1:
        raise UserError(f"rows must be positive, got {rows}")
    steps = rows * epochs // global_batch
    steps = min(steps, max_steps) if max_steps else steps
    if steps < 1:
        raise UserError(f"{rows} rows x {epochs} epochs do not fill one global batch of {global_batch}")
    return steps


def time_and_cost(plan: dict, rates: PeakRates, run: dict | None = None) -> dict:
    """Roofline step time, tokens/s per chip and, given ``run`` (``steps`` and how they were counted), the
    run's wall time and chip-hours, from a ``plan_step`` result (with ``global_batch`` and ``seq_len``)."""
    cost = step_cost(plan)
    times = roofline(cost["flops"], cost["bytes"], rates)
    chips = plan["num_devices"]
    tokens = plan["global_batch"] * plan["seq_len"]
    result = {
        "device": rates.device, "peak_flops_per_s": rates.flops_per_s, "hbm_bytes_per_s": rates.bytes_per_s,
        "hbm_bandwidth_source": rates.bandwidth_source, "chips": chips,
        "flops_per_device": cost["flops"], "bytes_per_device": cost["bytes"],
        "loop_flops_per_device": cost["loop_flops"], "cost_source": cost["source"], **times,
        "global_batch": plan["global_batch"], "seq_len": plan["seq_len"], "tokens_per_step": tokens,
        "tokens_per_s_per_chip": tokens / times["step_s"] / chips,
    }
    if run is not None:
        wall_s = run["steps"] * times["step_s"]
        result["run"] = dict(run, wall_s=wall_s, wall_hours=wall_s / SECONDS_PER_HOUR,
                             chip_hours=wall_s * chips / SECONDS_PER_HOUR)
    return result


# Printed with the figures and stored in --json: what the roofline leaves out, so it reads as a lower bound.
ASSUMPTIONS = (
    "roofline lower bound: each device at its peak dense bf16 FLOP/s or peak HBM bandwidth, whichever is slower",
    "no communication time (all-gathers, reduce-scatters) and no overlap losses modelled",
    "FLOPs and bytes are XLA's cost analysis of one device's program; the loop iterations it counts once are "
    "added from the jaxpr's matrix products (split evenly over devices), and bytes scaled by the same factor",
    "every sequence full (global batch x seq len tokens per step); no data loading, evaluation or checkpoint time",
)
