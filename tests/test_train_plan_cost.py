"""``train plan``'s time and cost: XLA's FLOP count of a tiny train step against a hand count, the roofline
and chip-hours arithmetic exactly, and one clear error for each missing input (CPU, one device, seconds)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dflash_jax.errors import UserError
from dflash_jax.training import plan
from dflash_jax.training.plan import PeakRates

# The tiny step: a frozen "target" matmul, then a scan over CHUNKS rematerialised chunks of a trained
# two-matmul "draft" (the train step's shape: target forward once, draft chunks under jax.checkpoint).
ROWS, D_IN, HIDDEN, D_MID, D_OUT, CHUNKS = 64, 32, 48, 40, 24, 4
# XLA also counts the elementwise work (tanh, squares, sums, the SGD update) that the hand count leaves out:
# a few percent of this step's matrix products.
TOLERANCE = 0.03


def _tiny_step(frozen, w1, w2, x):
    def loss(params):
        feats = jax.lax.stop_gradient(x @ frozen)  # the frozen target: forward only

        @jax.checkpoint
        def body(total, chunk):
            h = jnp.tanh(chunk @ params[0])
            return total + jnp.sum((h @ params[1]) ** 2), None

        total, _ = jax.lax.scan(body, 0.0, feats.reshape(CHUNKS, ROWS // CHUNKS, HIDDEN))
        return total

    # the loss is returned, as the train step returns it in its metrics: XLA keeps the forward pass's loop
    value, grads = jax.value_and_grad(loss)((w1, w2))
    return w1 - 1e-3 * grads[0], w2 - 1e-3 * grads[1], value


def _hand_flops() -> int:
    """2*M*N*K per matmul. Frozen: forward only. Trained, per chunk of m rows: the forward twice (once in the
    forward pass, once recomputed by the rematerialised backward), then dW2, dh and dW1 (no gradient flows
    into the stop_gradient features, so no d(features))."""
    frozen = 2 * ROWS * D_IN * HIDDEN
    m = ROWS // CHUNKS
    first, second = 2 * m * HIDDEN * D_MID, 2 * m * D_MID * D_OUT
    per_chunk = 2 * (first + second) + second + second + first  # 2 forwards, dW2, dh, dW1
    return frozen + CHUNKS * per_chunk


@pytest.fixture(scope="module")
def tiny_plan():
    args = [jax.ShapeDtypeStruct(s, jnp.float32)
            for s in ((D_IN, HIDDEN), (HIDDEN, D_MID), (D_MID, D_OUT), (ROWS, D_IN))]
    traced = jax.jit(_tiny_step).trace(*args)
    return dict(plan.program_cost(traced.jaxpr, traced.lower().compile()), num_devices=1, global_batch=4,
                seq_len=16)


def test_xla_counts_the_loop_once_and_the_correction_matches_the_hand_count(tiny_plan):
    hand = _hand_flops()
    assert tiny_plan["matmul_flops"] == hand  # the jaxpr's matrix products: exactly the hand count
    assert tiny_plan["cost_source"] == "compiler" and tiny_plan["bytes_accessed"] > 0
    # XLA alone counts the chunk loop's body once: far below the hand count
    assert tiny_plan["flops"] < 0.7 * hand
    cost = plan.step_cost(tiny_plan)
    assert cost["loop_flops"] == hand - tiny_plan["matmul_flops_loops_once"] > 0
    assert abs(cost["flops"] - hand) / hand < TOLERANCE, (cost["flops"], hand)
    # bytes scaled by the same factor as the FLOPs
    assert cost["bytes"] == pytest.approx(tiny_plan["bytes_accessed"] * cost["flops"] / tiny_plan["flops"])


def test_the_flops_are_at_least_the_jaxprs_matrix_products(tiny_plan):
    # a compile-only GPU's module counted by the CPU client: cuBLAS calls are custom calls with no FLOPs
    gpu_like = dict(tiny_plan, flops=1000.0, cost_source="hlo", num_devices=2)
    cost = plan.step_cost(gpu_like)
    assert cost["flops"] == tiny_plan["matmul_flops"] / 2 and cost["source"].startswith("jaxpr matmuls")
    assert cost["bytes"] == tiny_plan["bytes_accessed"] * (1000.0 + cost["loop_flops"]) / 1000.0
    no_cost = dict(tiny_plan, flops=None, bytes_accessed=None, cost_source=None)
    assert plan.step_cost(no_cost)["flops"] == tiny_plan["matmul_flops"] and plan.step_cost(no_cost)["bytes"] == 0


def test_roofline_and_chip_hours_arithmetic(tiny_plan):
    # rates chosen so that each bound wins once
    compute_bound = PeakRates("test", flops_per_s=1e9, bytes_per_s=1e12, bandwidth_source="test")
    t = plan.time_and_cost(dict(tiny_plan, num_devices=2), compute_bound,
                           {"steps": plan.run_steps(64, 3, 1000, None)})
    # with two devices the loop iterations split over both; XLA's own figure is already per device
    per_device = tiny_plan["flops"] + (tiny_plan["matmul_flops"] - tiny_plan["matmul_flops_loops_once"]) / 2
    assert t["flops_per_device"] == per_device and t["compute_s"] == per_device / 1e9
    assert t["step_s"] == t["compute_s"] and t["bound"] == "compute"
    assert t["tokens_per_step"] == 64 and t["tokens_per_s_per_chip"] == 64 / t["step_s"] / 2
    assert t["run"]["steps"] == 1000 * 3 // 64 == 46
    assert t["run"]["wall_s"] == 46 * t["step_s"] and t["run"]["chip_hours"] == 46 * t["step_s"] * 2 / 3600

    memory_bound = PeakRates("test", flops_per_s=1e18, bytes_per_s=1e6, bandwidth_source="test")
    t = plan.time_and_cost(tiny_plan, memory_bound)
    assert t["bound"] == "memory" and t["step_s"] == t["memory_s"] == plan.step_cost(tiny_plan)["bytes"] / 1e6
    assert "run" not in t


def test_run_steps_follow_the_trainer():
    assert plan.run_steps(64, 6, 800_000, None) == 75_000
    assert plan.run_steps(64, 6, 800_000, 1000) == 1000  # capped by train.max_steps
    assert plan.run_steps(64, 6, None, 500) == 500  # max_steps alone: no rows needed
    with pytest.raises(UserError, match=r"row count \(--rows N\) or train.max_steps"):
        plan.run_steps(64, 6, None, None)
    with pytest.raises(UserError, match="do not fill one global batch"):
        plan.run_steps(64, 1, 10, None)


def test_peak_rates_from_the_spec_files():
    v5p = plan.peak_rates("v5p:2x2x2")  # a topology reads its chip kind
    assert (v5p.flops_per_s, v5p.bytes_per_s) == (459e12, 2765e9)
    h200 = plan.peak_rates("h200")  # a GPU's bandwidth from XLA's target config
    assert h200.flops_per_s == 989.5e12 and h200.bytes_per_s == 4.8e12 and h200.bandwidth_source == "h200.txtpb"
    for device in ("cpu", "local", "v4"):
        with pytest.raises(UserError, match=f"no peak rates for device '{device}'.*v5p"):
            plan.peak_rates(device)


def test_table_and_cli_errors(tiny_plan, capsys):
    from train.plan import format_time, main

    rates = dataclasses.replace(plan.peak_rates("v5e"), device="v5e")
    t = plan.time_and_cost(tiny_plan, rates, {"steps": 10, "rows": 800_000, "rows_assumed": True, "epochs": 6,
                                               "max_steps": None})
    text = "\n".join(format_time(dict(t, assumptions=list(plan.ASSUMPTIONS))))
    assert "LOWER BOUND" in text and "ASSUMED" in text and "chip-hours" in text and "tokens/s per chip" in text
    assert "no communication" in text
    assert format_time({"unavailable": "no peak rates for device 'cpu'"}) == [
        "time: not estimated (no peak rates for device 'cpu')"]
    assert main(["--pairing", "tiny-test", "--rows", "100"]) == 2
    assert "error: --rows goes with --config" in capsys.readouterr().err


def test_the_runs_rows_come_from_rows_then_data_limit_then_max_steps_then_the_assumption(tiny_plan):
    from train.plan import _time_and_cost, format_time

    def run_of(rows, limit, max_steps):
        t = _time_and_cost(tiny_plan, "v5p:2x2x2", {"epochs": 2, "max_steps": max_steps, "data_limit": limit}, rows)
        return t["run"], "\n".join(format_time(t))

    run, text = run_of(1000, 5000, None)
    assert (run["rows"], run["rows_from"], run["steps"]) == (1000, "--rows", 1000 * 2 // 4)
    run, text = run_of(None, 5000, 100)
    assert (run["rows"], run["rows_from"], run["steps"]) == (5000, "data.limit", 100)  # capped by max_steps
    assert "at most 5,000 rows (data.limit" in text and "/ global batch 4, capped at train.max_steps 100" in text
    run, text = run_of(None, None, 7)
    assert (run["rows"], run["steps"]) == (None, 7) and "train.max_steps; the rows are not known" in text
    run, text = run_of(None, None, None)
    assert run["rows_assumed"] and run["steps"] == plan.ASSUMED_ROWS * 2 // 4 and "ASSUMED" in text
    # a device without peak rates: the plan says so instead of a time
    assert "no peak rates for device 'cpu'" in _time_and_cost(tiny_plan, None, None, None)["unavailable"]
