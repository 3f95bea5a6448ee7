"""A short real training run on stories260K (llama2.c's real pretrained model, the copy shipped in the package):
the target writes its own stories (regenerate, temperature 1), a 1-layer draft trains for 120 steps, the loss
falls and the engine's real tau on held-out openings rises above that of the same draft untrained.

At this length the draft learns what is cheap first (the frequent tokens; run longer to see the context used:
docs/training.md), so the margins asserted are modest: loss -0.15 nats, tau +0.01 over untrained (measured
here: loss 5.24 -> 4.87, tau 1.000 -> 1.076)."""

from dflash_jax.assets import DEMO_TARGET
from dflash_jax.checkpoints.loading import load_tokenizer
from dflash_jax.checkpoints.hf_target import load_target
from dflash_jax.data.formats import Conversation
from dflash_jax.data.regenerate import first_prompt_ids, regenerate
from dflash_jax.engine.decoder import Decoder
from dflash_jax.engine.sampling import SamplingConfig
from dflash_jax.training.run_config import parse_run_config
from dflash_jax.training.trainer import build_draft_config, evaluate_tau, fit, prepare_run
from dflash_jax.checkpoints.official_draft import init_draft_params

OPENINGS = ["Once upon a time", "One day", "Lily", "Tom was", "There was a", "The sun", "A little", "Sam"]
HELD_OUT = ["The big dog", "Mia and Ben", "In the park,", "It was a sunny", "Grandma", "Two birds", "Jack had",
            "Every morning"]


def test_short_run_lowers_loss_and_raises_real_tau(tmp_path):
    target_dir = DEMO_TARGET
    tokenizer = load_tokenizer(target_dir)
    target_config, target_params = load_target(target_dir)
    examples = [Conversation(({"role": "user", "content": OPENINGS[i % len(OPENINGS)]},)) for i in range(128)]
    regenerate(Decoder(target_config, target_params), tokenizer, examples, tmp_path / "regen", batch_size=64,
               max_new_tokens=127, sampling=SamplingConfig(temperature=1.0), stop_tokens=(1, 2), seed=0,
               shard_size=128, use_chat_template=False, progress=False)
    assert not any(h.startswith(o) or o.startswith(h) for o in OPENINGS for h in HELD_OUT)

    cfg = parse_run_config({
        "target": {"path": str(target_dir)},
        "draft": {"num_layers": 1, "block_size": 8, "mask_token_id": 0, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 64},
        "data": {"train": str(tmp_path / "regen"), "max_length": 128},
        "train": {"epochs": 15, "global_batch": 16, "num_anchors": 16, "anchor_chunk": 16,
                  "learning_rate": 1e-2, "warmup_ratio": 0.1},
        "output": {"dir": str(tmp_path / "run"), "log_every": 10, "save_every": 1000, "eval_max_new_tokens": 64,
                   "eval_num_prompts": 8},
    }, "test")
    prompts = [first_prompt_ids(tokenizer, Conversation(({"role": "user", "content": h},)), False)
               for h in HELD_OUT]
    untrained = evaluate_tau(prepare_run(cfg, eval_prompts=prompts, log=lambda _: None),
                             init_draft_params(build_draft_config(cfg, target_config)[0], seed=0, std=0.02))
    logs = []
    result = fit(cfg, eval_prompts=prompts, progress=False, log=logs.append)
    assert result.steps == 120
    import json

    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, tau {untrained:.3f} -> {result.eval_tau:.3f}")
    assert losses[-1] < losses[0] - 0.15, losses
    assert result.eval_tau > untrained + 0.01, (untrained, result.eval_tau)
    assert (result.export_dir / "draft" / "model.safetensors").is_file()
