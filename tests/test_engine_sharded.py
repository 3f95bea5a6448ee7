"""Sharded inference: the engine on 8 fake CPU devices (tensor, data and fsdp meshes, the training's sharding
rules) gives the same tokens and acceptance lengths as one device, for DFlash and the baseline, greedy (every
mesh) and sampling with a fixed seed (data=4, tensor=2). Runs tests/sharded_decode_check.py in two subprocesses
side by side (the device count is fixed when JAX starts; each process runs part of the meshes, both are
compile-bound and single-threaded), their results merged."""

from pathlib import Path

from engine_tiny import run_checks

TESTS = Path(__file__).parent
# Two groups of about the same compile time (measured ~70 s and ~55 s on XLA:CPU).
GROUPS = (("one", "tensor2_data4", "tensor8"), ("fsdp2_tensor2_data2", "short", "gathers"))


def test_sharded_decoding_equals_one_device():
    outs = run_checks(TESTS / "sharded_decode_check.py", GROUPS)
    assert all(o["devices"] == 8 for o in outs)
    out = {"runs": {}, "param_specs": {}}
    for o in outs:
        assert not set(o["runs"]) & set(out["runs"])  # every run comes from one process
        out["runs"].update(o["runs"])
        out["param_specs"].update(o["param_specs"])
    (out["pallas_gathers"],) = [o["pallas_gathers"] for o in outs if o["pallas_gathers"] is not None]
    assert {key.split("/")[0] for key in out["runs"]} == {"one", "tensor2_data4", "tensor8", "fsdp2_tensor2_data2"}
    runs = out["runs"]
    for key, run in runs.items():
        mesh, mode, kind = key.split("/")
        if mesh == "one":
            continue
        reference = runs[f"one/{mode}/{'loop' if kind == 'pallas' else kind}"]
        assert run["tokens"] == reference["tokens"], key
        assert run["accept"] == reference["accept"], key
    assert {"tensor2_data4/sample/dflash", "tensor2_data4/sample/ar"} <= set(runs)
    assert runs["one/greedy/dflash"]["tokens"] == runs["one/greedy/ar"]["tokens"]  # lossless, as ever
    assert runs["one/greedy/oracle"]["tokens"] == runs["one/greedy/ar"]["tokens"]
    assert "tensor2_data4/short/pallas" in runs  # the sharded Pallas kernel, compared with the loop above
    assert out["pallas_gathers"]["per_shard"] == 0 < out["pallas_gathers"]["no_mesh"], out["pallas_gathers"]
    assert {a for row in runs["one/greedy/oracle"]["accept"] for a in row} >= {1, 2, 3}
    # The params really were split: MLP and attention over tensor, embeddings over fsdp where it divides.
    assert any("tensor" in s for s in out["param_specs"]["tensor8"])
    assert any("fsdp" in s for s in out["param_specs"]["fsdp2_tensor2_data2"])
