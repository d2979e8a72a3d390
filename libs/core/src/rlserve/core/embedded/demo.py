"""`make demo`: builds the embedded default and reports the warmed-up policy's accuracy.

Usage: python -m rlserve.core.embedded.demo [--config FILE] [section.field=value ...]

Until the trainer lands this is the main job: the part of the embedded default run that
comes before PPO (tiny model, tokenizer, task, supervised warm-up, held-out accuracy).
"""

import argparse
import sys
import time
from pathlib import Path

import transformers

from rlserve.core.config import ConfigError, dump_config, load_config
from rlserve.core.embedded.prepare import prepare_embedded_default
from rlserve.core.run_config import RunConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="YAML run config (default: built-in)")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    try:
        config = load_config(RunConfig, args.config, args.overrides)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    run_dir = Path(config.trainer.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))

    started = time.perf_counter()
    result = prepare_embedded_default(
        run_dir,
        tiny=config.model.tiny,
        task=config.data.arithmetic,
        seed=config.trainer.seed,
        max_new_tokens=config.rollout.max_new_tokens,
        eval_prompts=config.rollout.eval_prompts,
    )
    total_s = time.perf_counter() - started
    print(
        f"embedded default ready in {total_s:.1f} s\n"
        f"  warm-up: {config.model.tiny.sft_steps} steps x {config.model.tiny.sft_batch_samples}"
        f" samples in {result.warmup_s:.1f} s, final loss {result.warmup_final_loss:.3f}\n"
        f"  held-out greedy exact match ({config.rollout.eval_prompts} prompts):"
        f" {100 * result.warmup_accuracy:.1f}%\n"
        f"  model (HF format, safetensors): {result.model_dir}\n"
        f"  data: {result.train_path}, {result.eval_path}\n"
        f"  config: {run_dir / 'config.yaml'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
