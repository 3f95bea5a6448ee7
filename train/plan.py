"""``python -m train plan``: compile the train step ahead of time from abstract shapes (no weights are read or
allocated) and print what one device must hold and compute per optimizer step.

The models come from a pairing file (--pairing NAME_OR_YAML: its target and draft configs) or from a run
config (--config RUN.yaml: the target's config.json at target.path, the draft as 'python -m train fit' builds
it). Batch, anchors, chunking, accumulation, dtype and mesh default to the run config's values, or to the
paper's setting (8 x 3072 tokens, 512 anchors in chunks of 64, bfloat16) with --pairing; flags override.

The figures are XLA's accounting of the compiled per-device program (memory_analysis, cost_analysis) on the
backend that compiles it. To plan a multi-device mesh on a CPU-only machine, simulate the devices with
--cpu-devices N (N = the mesh size); the memory is then XLA:CPU's buffer assignment, a proxy for an
accelerator's. The plan never starts devices of its own: without --cpu-devices a mesh larger than the
machine is an error that says which flag to pass.

To plan for an accelerator this machine does not have, pass --device (h100, h200, b200: XLA:GPU through the CUDA
plugin; v5e, v5p, v6e or a TPU topology such as v5p:2x2x2: the TPU compiler through libtpu; needs the aot extra,
pip install -e ".[aot]"). The step is then compiled by that device's compiler over a mesh of compile-only
devices, as many as the mesh names (on a topology: all of its chips, a -1 axis taking the rest; on a bare
name a -1 axis is 1), and the memory is that compiler's buffer assignment, compared with the device's memory.

For such a device the plan also prints a roofline step time (the larger of the step's per-device FLOPs at the
chip's peak bf16 FLOP/s and its bytes at peak HBM bandwidth, from XLA's cost analysis with the loop iterations
it counts once added back), tokens/s per chip and, with --config, the run's steps, wall time and chip-hours
(rows: --rows, else data.limit, else an assumption it states): a lower bound, no communication modelled.

Example: the Qwen3-8B step on eight H200s, sharded over fsdp:

    python -m train plan --pairing qwen3-8b-dflash-b16 --mesh fsdp=8 --device h200
"""

from __future__ import annotations

import argparse
import json
import math

from dflash_jax.errors import UserError
from infer.cli import Parser, UsageError, add_device_args, run_cli, setup_devices


PROG = "python -m train plan"
GIB = 1 << 30
DEFAULT_MEMORY_GIB = 80
PAPER = {"global_batch": 8, "seq_len": 3072, "num_anchors": 512, "anchor_chunk": 64, "accum_steps": 1,
         "dtype": "bfloat16"}


def build_parser() -> argparse.ArgumentParser:
    from dflash_jax.aot import DEVICES
    from dflash_jax.training.plan import ASSUMED_ROWS

    parser = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog="Exit codes: 0 planned (whether or not it fits), 2 bad arguments or settings "
                           "(one 'error: ...' line on stderr).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pairing", metavar="NAME_OR_YAML",
                        help="a pairing file (configs/<name>.yaml, by name or path): its target and draft")
    source.add_argument("--config", metavar="RUN.yaml", help="a run config of 'python -m train fit'")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="with --config: override a run config key (repeatable)")
    parser.add_argument("--num-draft-layers", type=int, metavar="N",
                        help="with --config: draft depth of a new draft (same as --set draft.num_layers=N)")
    parser.add_argument("--block-size", type=int, metavar="B",
                        help="with --config: block size of a new draft (same as --set draft.block_size=B)")
    parser.add_argument("--mesh", metavar="SPEC",
                        help="device mesh, e.g. data=1,fsdp=8 or fsdp=4,tensor=2 (one axis may be -1); "
                             "default: the run config's mesh, or every device on 'data' (with --device: one "
                             "device, or every chip of a TPU topology)")
    parser.add_argument("--experts", "--mxfp4", dest="experts", choices=("dequantize", "packed"),
                        help="the frozen target's quantised experts (gpt-oss's MXFP4, block FP8, Kimi's INT4) "
                             "kept as stored on the devices ('packed') or dequantised at load (default; with "
                             "--config, its target.experts; --mxfp4 is its older name)")
    parser.add_argument("--global-batch", type=int, metavar="G", help="sequences per optimizer step (default 8)")
    parser.add_argument("--seq-len", type=int, metavar="L", help="tokens per sequence (default 3072)")
    parser.add_argument("--num-anchors", type=int, metavar="A", help="anchors per sequence (default 512)")
    parser.add_argument("--anchor-chunk", type=int, metavar="C",
                        help="anchors per rematerialised chunk (default 64; >= --num-anchors: one chunk)")
    parser.add_argument("--accum-steps", type=int, metavar="K", help="accumulation micro-steps (default 1)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "auto"),
                        help="compute dtype of target and draft (default bfloat16; 'auto' plans for an "
                             "accelerator, i.e. bfloat16); the draft's master weights and Adam state are float32")
    parser.add_argument("--loss", choices=("ce", "kl", "ce+kl"),
                        help="training loss (default: the run config's, or ce); kl and ce+kl also run the "
                             "target's head over the labelled block positions, chunk by chunk")
    parser.add_argument("--device", metavar="DEVICE",
                        help=f"compile for this device without having it: {', '.join(DEVICES)}, or a TPU topology "
                             "such as v5p:2x2x2 (default: this machine's backend, as cpu; local: this process's "
                             "devices, compared with their own memory)")
    parser.add_argument("--device-memory-gib", type=float, metavar="GIB",
                        help="memory of one device to compare the total with (default: the --device's, else 80)")
    parser.add_argument("--rows", type=int, metavar="N",
                        help="with --config: rows (sequences) of the run's training data, for its number of steps "
                             "(epochs x N / global batch, capped by train.max_steps) and chip-hours (default: "
                             "data.limit, else train.max_steps alone if set, else an assumed "
                             f"{ASSUMED_ROWS:,} rows, the DFlash paper's set; the data is not read)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_device_args(parser)
    return parser


def _target_config_of(path: str, revision: str | None = None):
    from dflash_jax.checkpoints import orbax_io
    from dflash_jax.checkpoints.hub import CONFIG_FILES, resolve_checkpoint
    from dflash_jax.models.config import ConfigError, TargetConfig

    p = resolve_checkpoint(path, revision, "target.path", CONFIG_FILES)  # of a Hub id: its config.json alone
    if orbax_io.is_orbax_dir(p):
        meta = orbax_io.read_meta(p)
        if meta["kind"] != "target":
            raise ConfigError(f"{p}: holds a {meta['kind']} checkpoint, but target.path must be a target")
        return TargetConfig.from_dict(meta["config"], source=f"{p / orbax_io.META_FILE} [config]")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{p}: no config.json (target.path must be a Hugging Face directory or an Orbax "
                          "checkpoint of this project)")
    return TargetConfig.from_json(p / "config.json")


def _draft_config_of(cfg: dict, target):
    """The draft 'fit' would train, from configs only (``draft.init``'s weights are not read)."""
    from dflash_jax.checkpoints import orbax_io
    from dflash_jax.checkpoints.hub import CONFIG_FILES, resolve_checkpoint
    from dflash_jax.models.config import ConfigError
    from dflash_jax.models.draft_config import DraftConfig
    from dflash_jax.training.trainer import build_draft_config

    init = cfg["draft"]["init"]
    if not init:
        return build_draft_config(cfg, target)[0]
    p = resolve_checkpoint(init, cfg["draft"]["init_revision"], "draft.init", CONFIG_FILES)
    if orbax_io.is_orbax_dir(p):
        meta = orbax_io.read_meta(p)
        if meta["kind"] != "draft":
            raise ConfigError(f"{p}: holds a {meta['kind']} checkpoint, but draft.init must be a draft")
        config = DraftConfig.from_dict(meta["config"], source=f"{p / orbax_io.META_FILE} [config]")
    elif (p / "config.json").is_file():
        config = DraftConfig.from_json(p / "config.json")
    else:
        raise ConfigError(f"{p}: no config.json (draft.init must be an official draft directory or an Orbax "
                          "checkpoint of this project)")
    config.validate_against(target, source=f"draft.init {init}")
    return config


def _settings(args: argparse.Namespace) -> dict:
    """Models, step and mesh settings from --pairing or --config, then the flags."""
    from dflash_jax.training.loss import DEFAULT_GAMMAS

    if args.pairing is not None:
        if args.overrides or args.num_draft_layers is not None or args.block_size is not None:
            raise UsageError("--set, --num-draft-layers and --block-size go with --config (a pairing file fixes "
                             "its draft)")
        if args.rows is not None:
            raise UsageError("--rows goes with --config (the run's epochs and max_steps come from it)")
        from dflash_jax.configs import load_pairing

        pairing = load_pairing(args.pairing)
        name, target, draft = pairing.name, pairing.target, pairing.draft
        packed = args.experts == "packed"
        base = dict(PAPER, mesh=None, gamma=None, optimizer={}, loss="ce", kl_weight=0.5)
    else:
        from dflash_jax.training.run_config import load_run_config
        from dflash_jax.training.trainer import UNIFORM_GAMMA

        overrides = list(args.overrides)
        if args.num_draft_layers is not None:
            overrides.append(f"draft.num_layers={args.num_draft_layers}")
        if args.block_size is not None:
            overrides.append(f"draft.block_size={args.block_size}")
        cfg = load_run_config(args.config, overrides)
        target = _target_config_of(cfg["target"]["path"], cfg["target"]["revision"])
        packed = (args.experts or cfg["target"]["experts"]) == "packed"
        name = args.config
        draft = _draft_config_of(cfg, target)
        t = cfg["train"]
        base = {"global_batch": t["global_batch"], "seq_len": cfg["data"]["max_length"],
                "num_anchors": t["num_anchors"], "anchor_chunk": t["anchor_chunk"], "accum_steps": t["accum_steps"],
                "dtype": t["dtype"], "mesh": cfg["mesh"],
                "gamma": UNIFORM_GAMMA if t["uniform_loss"] else t["gamma"], "loss": t["loss"],
                "kl_weight": t["kl_weight"], "loss_mode": t["loss_mode"], "dspark_loss_weights": t["dspark_loss_weights"],
                "run": {"epochs": t["epochs"], "max_steps": t["max_steps"], "data_limit": cfg["data"]["limit"]},
                "optimizer": {"learning_rate": t["learning_rate"], "warmup_ratio": t["warmup_ratio"],
                              "clip_norm": t["clip_norm"], "weight_decay": t["weight_decay"],
                              "min_lr_ratio": t["min_lr_ratio"], "optimizer": t["optimizer"],
                              "muon_learning_rate": t["muon_learning_rate"],
                              "muon_momentum": float(t["muon_momentum"])}}
    s = dict(base)
    for key in ("global_batch", "seq_len", "num_anchors", "anchor_chunk", "accum_steps", "dtype", "mesh", "loss"):
        value = getattr(args, key)
        if value is not None:
            s[key] = value
    for key in ("global_batch", "seq_len", "num_anchors", "anchor_chunk", "accum_steps"):
        if s[key] < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be positive, got {s[key]}")
    if s["global_batch"] % s["accum_steps"]:
        raise UsageError(f"global batch {s['global_batch']} is not divisible by --accum-steps {s['accum_steps']}")
    if args.rows is not None and args.rows < 1:
        raise UsageError(f"--rows must be positive, got {args.rows}")
    if args.device_memory_gib is not None and args.device_memory_gib <= 0:
        raise UsageError(f"--device-memory-gib must be positive, got {args.device_memory_gib}")
    if s["dtype"] == "auto":
        s["dtype"] = "bfloat16"  # what 'fit' computes in on an accelerator, the machine a plan is for
    if s["gamma"] is None:
        s["gamma"] = DEFAULT_GAMMAS.get(draft.block_size, 7.0)  # the decay does not change shapes
    if packed:  # plan the frozen target with its experts kept quantised
        from dflash_jax.checkpoints.expert_layouts import with_packed_experts

        target = with_packed_experts(target, "packed", name)
    s.update(name=name, target=target, draft=draft)
    return s


def _make_mesh(spec, cpu_devices: int | None):
    import jax

    from dflash_jax import sharding

    available = jax.device_count()
    try:
        return sharding.make_mesh(spec)
    except UserError as e:
        wanted = _wanted_devices(spec)
        if wanted and wanted > available and jax.default_backend() == "cpu":
            hint = (f"; pass --cpu-devices {wanted} (--cpu-devices {cpu_devices} simulates only {cpu_devices})"
                    if cpu_devices else f"; to plan it on this CPU, simulate the devices with --cpu-devices {wanted}")
            raise UserError(f"{e}{hint}") from None
        raise


def _wanted_devices(spec) -> int | None:
    """Devices a mesh spec names when every axis is fixed (None with a -1 axis or a malformed spec)."""
    if not spec:
        return None
    items = dict(spec) if not isinstance(spec, str) else dict(p.partition("=")[::2] for p in spec.split(","))
    try:
        sizes = [int(v) for v in items.values()]
    except (TypeError, ValueError):
        return None
    return math.prod(sizes) if all(n > 0 for n in sizes) else None


def _device_of(args: argparse.Namespace) -> str | None:
    """The accelerator --device names (None: compile on this machine's backend, also for --device cpu), after
    checking it goes with the other device flags. Runs before JAX starts a backend."""
    from dflash_jax.aot import DEVICES, TPU_KINDS

    device = args.device
    if device is None or device == "cpu":
        return None
    kind = device.split(":")[0]
    if device not in DEVICES and not (kind in TPU_KINDS and ":" in device):
        raise UsageError(f"unknown device {device!r} (choose from {', '.join(DEVICES)}, or a TPU topology such as "
                         "v5p:2x2x2)")
    multi_process = (args.coordinator or args.num_processes is not None or args.process_id is not None
                     or args.distributed)
    if device == "local":
        # this process's own devices, as without --device but compared with their own memory: JAX's platform
        # is the user's, and --cpu-devices still simulates CPU ones
        if multi_process:
            raise UsageError("--device local plans over this process's devices alone: drop the multi-process flags")
        return device
    if args.cpu_devices is not None:
        raise UsageError(f"--cpu-devices simulates CPU devices, --device {device} compiles for compile-only {kind} "
                         "devices (as many as --mesh names): pass one of them")
    if multi_process:
        raise UsageError(f"--device {device} plans on this machine alone: drop the multi-process flags")
    # The CUDA plugin serves compile-only GPUs only when JAX's own backend is the CPU (on a machine without a
    # GPU its start-up check of the CUDA libraries would fail and unregister it); the plan runs nothing, so the
    # CPU is all it needs. JAX is imported by now (the compile cache) but has not chosen a backend yet, so the
    # setting still takes; an explicit JAX_PLATFORMS is left to the user, as 'infer plan' does.
    import jax

    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    return device  # (aot.compile_target turns the persistent cache off for compile-only devices)


def memory_limit(device_memory_gib: float | None, target=None) -> float:
    """Bytes of one device to compare the plan with: --device-memory-gib, else the compiled-for device's
    memory (``aot.CompileTarget.memory_bytes``), else 80 GiB (the goal of this project's plans)."""
    if device_memory_gib is not None:
        return device_memory_gib * GIB
    if target is not None and target.memory_bytes:
        return target.memory_bytes
    return DEFAULT_MEMORY_GIB * GIB


def plan_main(args: argparse.Namespace) -> int:
    device = _device_of(args)
    setup_devices(args)
    s = _settings(args)  # configs are checked before JAX starts a backend

    import jax

    from dflash_jax.precision import resolve_dtype
    from dflash_jax.training.plan import compile_devices, plan_step
    from dflash_jax.training.step import StepConfig, make_optimizer

    target_devices = None
    if device is None:
        mesh = _make_mesh(s["mesh"], args.cpu_devices)
    else:
        from dflash_jax import sharding

        sizes, target_devices = compile_devices(s["mesh"], device)
        mesh = sharding.make_mesh(sizes, devices=target_devices.devices)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if s["global_batch"] % batch_shards:
        raise UsageError(f"global batch {s['global_batch']} is not divisible by data x fsdp = {batch_shards} (the "
                         "batch is sharded over both axes); change --global-batch or --mesh")
    target, draft = s["target"], s["draft"]
    step_cfg = StepConfig(block_size=draft.block_size, gamma=float(s["gamma"]), mask_token_id=draft.mask_token_id,
                          feature_layers=draft.target_layer_ids, num_anchors=s["num_anchors"],
                          anchor_chunk=s["anchor_chunk"], accum_steps=s["accum_steps"],
                          tied_head=target.tie_word_embeddings, loss=s["loss"], kl_weight=float(s["kl_weight"]),
                          loss_mode=s.get("loss_mode", "standard"),  # Muon's state (one moment) is planned too
                          dspark_weights=tuple(s.get("dspark_loss_weights") or (0.1, 0.9, 1.0)) if draft.dspark
                          else None)
    optimizer, schedule = make_optimizer(total_steps=1000, **s["optimizer"])
    if not args.json:
        shown = ",".join(f"{a}={n}" for a, n in mesh.shape.items())
        where = (f"{jax.default_backend()} device(s)" if target_devices is None else
                 f"{'' if device == 'local' else 'compile-only '}{target_devices.name} device(s)")
        print(f"compiling the train step of {s['name']} for mesh {shown} ({mesh.devices.size} {where}) ...",
              flush=True)
    result = plan_step(target, draft, step_cfg, mesh, s["global_batch"], s["seq_len"], resolve_dtype(s["dtype"]),
                       optimizer, schedule, target=target_devices)
    limit = memory_limit(args.device_memory_gib, target_devices)
    result.update(
        name=s["name"], dtype=s["dtype"], global_batch=s["global_batch"], seq_len=s["seq_len"],
        num_anchors=s["num_anchors"], anchor_chunk=min(s["anchor_chunk"], s["num_anchors"]),
        accum_steps=s["accum_steps"], loss=s["loss"], block_size=draft.block_size, num_draft_layers=draft.num_hidden_layers,
        device_memory_gib=limit / GIB, fits=result["resident_total_bytes"] <= limit,
    )
    if device is not None:
        result["compile_only"] = device != "local"
    result["time"] = _time_and_cost(result, device, s.get("run"), args.rows)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_plan(result))
    return 0


def _time_and_cost(result: dict, device: str | None, run_settings: dict | None, rows: int | None) -> dict:
    """The roofline time section of a plan: step time, tokens/s per chip and, with a run config, the run's
    steps, wall time and chip-hours; ``{"unavailable": why}`` for a device with no peak rates (CPU, local)."""
    from dflash_jax.training.plan import ASSUMED_ROWS, ASSUMPTIONS, peak_rates, run_steps, time_and_cost

    try:
        rates = peak_rates(device or "cpu")
    except UserError as e:
        return {"unavailable": str(e)}
    run = None
    if run_settings is not None:
        # the rows, without reading the data: --rows, else data.limit (the mixture holds at most that many),
        # else none when train.max_steps alone counts the steps, else the stated assumption
        if rows is not None:
            counted_rows, rows_from = rows, "--rows"
        elif run_settings["data_limit"]:
            counted_rows, rows_from = run_settings["data_limit"], "data.limit"
        elif run_settings["max_steps"]:
            counted_rows, rows_from = None, "train.max_steps"
        else:
            counted_rows, rows_from = ASSUMED_ROWS, "assumed"
        steps = run_steps(result["global_batch"], run_settings["epochs"], counted_rows, run_settings["max_steps"])
        run = {"steps": steps, "rows": counted_rows, "rows_from": rows_from, "rows_assumed": rows_from == "assumed",
               "epochs": run_settings["epochs"], "max_steps": run_settings["max_steps"]}
    return dict(time_and_cost(result, rates, run), assumptions=list(ASSUMPTIONS))


def format_time(t: dict) -> list[str]:
    """The table's lines for a plan's ``time`` section."""
    if "unavailable" in t:
        return [f"time: not estimated ({t['unavailable']})"]
    bound = "compute" if t["bound"] == "compute" else "HBM bandwidth"
    lines = [
        f"roofline time per step (a LOWER BOUND, {t['chips']} x {t['device']} at peak: "
        f"{t['peak_flops_per_s'] / 1e12:.1f} bf16 TFLOP/s, {t['hbm_bytes_per_s'] / 1e12:.2f} TB/s HBM per chip):",
        f"  per device: {t['flops_per_device']:.3e} FLOPs ({t['loop_flops_per_device']:.3e} of them from loop "
        f"iterations XLA counts once), {t['bytes_per_device']:.3e} bytes; {t['cost_source']}",
        f"  compute {t['compute_s'] * 1e3:.1f} ms, memory {t['memory_s'] * 1e3:.1f} ms -> step "
        f"{t['step_s'] * 1e3:.1f} ms, {bound}-bound",
        f"  {t['tokens_per_step']:,} tokens per step (global batch {t['global_batch']} x {t['seq_len']}) -> "
        f"{t['tokens_per_s_per_chip']:,.0f} tokens/s per chip",
    ]
    run = t.get("run")
    if run:
        if run["rows"] is None:
            counted = "train.max_steps; the rows are not known"
        elif run["rows_assumed"]:
            counted = f"{run['rows']:,} rows ASSUMED (pass --rows N)"
        elif run.get("rows_from") == "data.limit":
            counted = f"at most {run['rows']:,} rows (data.limit; pass --rows N)"
        else:
            counted = f"{run['rows']:,} rows"
        if run["rows"] is not None:
            cap = f", capped at train.max_steps {run['max_steps']:,}" if run["max_steps"] else ""
            counted = f"{counted} x {run['epochs']} epochs / global batch {t['global_batch']}{cap}"
        lines.append(f"  run: {run['steps']:,} steps ({counted}) -> {run['wall_hours']:.2f} h wall, "
                     f"{run['chip_hours']:,.1f} chip-hours")
    lines += [f"  assumes: {a}" for a in t["assumptions"]]
    return lines


def format_plan(r: dict) -> str:
    mesh = ",".join(f"{a}={n}" for a, n in r["mesh"].items())
    unit, scale = ("GiB", GIB) if r["resident_total_bytes"] >= GIB // 10 else ("MiB", 1 << 20)

    def row(label: str, n: int, sign: str = "") -> str:
        return f"  {label:<38}{sign + format(n / scale, '.2f'):>11}"

    compile_only = r.get("compile_only", True)
    where = (f"{r['backend']} device(s)" if "device" not in r else
             f"{'compile-only ' if compile_only else ''}{r['device']} device(s), {r['backend']} compiler")
    lines = [
        f"train step of {r['name']}: mesh {mesh} ({r['num_devices']} {where}), {r['dtype']}",
        f"  batch {r['global_batch']} x {r['seq_len']} tokens, {r['num_anchors']} anchors per sequence in chunks "
        f"of {r['anchor_chunk']}, block {r['block_size']}, {r['num_draft_layers']} draft layers, "
        f"{r['accum_steps']} accumulation step(s), loss {r['loss']}",
        f"  traced and lowered in {r['lower_seconds']:.1f} s, compiled in {r['compile_seconds']:.1f} s",
        "",
        f"per device{unit:>41}",
        row("target params (all layers)", r["target_param_bytes"]),
        row("draft state (fp32 params + Adam)", r["draft_state_bytes"]),
        "",
        row("arguments", r["argument_bytes"]),
        row("outputs", r["output_bytes"]),
        row("temporaries", r["temp_bytes"]),
        row("aliased (donated state)", r["alias_bytes"], "-"),
        row("total (XLA)", r["total_bytes"]),
        row("inputs the step never reads", r["dropped_argument_bytes"], "+"),
        row("total resident", r["resident_total_bytes"]),
    ]
    verdict = "fits" if r["fits"] else "does NOT fit"
    lines.append(f"  -> {verdict} in {r['device_memory_gib']:.4g} GiB per device "
                 f"({100 * r['resident_total_bytes'] / (r['device_memory_gib'] * GIB):.1f}%)")
    lines.append("     (inputs never read: target layers past the last feature layer, which jit drops from the "
                 "program but the trainer keeps on the device)")
    lines.append("")
    n = r["num_devices"]
    approx = "" if r["matmul_flops_exact"] else " (a while loop counted once: a lower bound)"
    lines.append(f"matmul FLOPs per step{approx}: {r['matmul_flops']:.3e} in all, "
                 f"{r['matmul_flops'] / n:.3e} per device if evenly split")
    if r["flops"] is None:
        lines.append("XLA cost analysis: no FLOPs reported by this backend")
    else:
        lines.append(f"XLA cost analysis: {r['flops']:.3e} FLOPs per device (counts each loop body once: the "
                     f"anchor-chunk and accumulation loops run it more often)")
    if "device" in r:
        kernels = ", ".join(f"{name} x{n}" for name, n in sorted(r["fused_kernels"].items())) or "none"
        lines.append(f"fused kernels in the compiled step: {kernels}")
        if compile_only:
            lines.append(f"memory: the {r['backend'].upper()} compiler's buffer assignment for {r['device']}, "
                         "compiled without the device (not a measurement on one)")
        else:
            lines.append(f"memory: XLA's buffer assignment on {r['device']} (compiled, not run)")
    elif r["backend"] == "cpu":
        lines.append("memory: XLA:CPU's buffer assignment, a proxy for an accelerator's, not a measurement of one")
    if "time" in r:
        lines += [""] + format_time(r["time"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), plan_main, argv)
