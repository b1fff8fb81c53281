"""``rollout`` group, part 1: prompt data, the four batch knobs, sampling."""

from __future__ import annotations

from furlong.kit.chat_masks import MASK_STYLES

from ._util import json_object

__all__ = ["add"]


def add(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--prompt-data", default=None,
                   help="Prompt set: JSONL, .parquet, a save_to_disk folder or .arrow/.csv/.tsv (the file chooses "
                        "the data source unless --data-source is given); PATH@[a:b] keeps rows a..b.")
    g.add_argument("--input-key", default="input", help="Row field holding the prompt (a.b: a nested field).")
    g.add_argument("--label-key", default=None,
                   help="Row field holding the label (reference answer); a.b: a nested field.")
    g.add_argument("--metadata-key", default="metadata",
                   help="Row field holding the sample metadata (an object); several comma-separated fields: "
                        "each kept under its own name.")
    g.add_argument("--tool-key", default="tools", help="Row field holding tool specs (stored as metadata['tools']).")
    g.add_argument("--multimodal-keys", type=json_object, default=None,
                   help="JSON mapping of multimodal row fields (not supported yet).")
    g.add_argument("--apply-chat-template", action="store_true",
                   help="Render prompts with the tokenizer's chat template at load; never implied.")
    g.add_argument("--apply-chat-template-kwargs", type=json_object, default={},
                   help="JSON object of extra chat-template arguments, e.g. '{\"enable_thinking\": false}'.")
    g.add_argument("--loss-mask-type", choices=MASK_STYLES, default="qwen",
                   help="How the assistant turns of a conversation are found (the sft rollout, furlong.kit.chat_masks).")
    g.add_argument("--chat-template-path", default=None,
                   help="Chat template file used instead of the tokenizer's (also sent as --sglang-chat-template).")
    g.add_argument("--rollout-shuffle", action="store_true", help="Shuffle prompts each epoch (seed: rollout seed + epoch).")
    g.add_argument("--rollout-seed", type=int, default=42, help="Seed of the prompt shuffle and of sampling seeds.")
    g.add_argument("--num-rollout", type=int, default=None,
                   help="Rollout iterations to run (required; 0 = evaluate only).")
    g.add_argument("--rollout-batch-size", type=int, default=None,
                   help="Prompts per rollout. Four knobs: rollout_batch_size x n_samples_per_prompt = "
                        "global_batch_size x num_steps_per_rollout; give three (or fewer) and the rest is derived.")
    g.add_argument("--n-samples-per-prompt", type=int, default=1, help="Responses per prompt (the GRPO group size).")
    g.add_argument("--global-batch-size", type=int, default=None, help="Samples per optimizer step.")
    g.add_argument("--num-steps-per-rollout", type=int, default=None,
                   help="Optimizer steps per rollout (default 1 when it cannot be derived); "
                        "weights are synced once per rollout whatever this is.")
    g.add_argument("--over-sampling-batch-size", type=int, default=None,
                   help="Groups drawn per sampling wave (default: --rollout-batch-size); at least --rollout-batch-size.")
    g.add_argument("--max-sampling-waves", type=int, default=32,
                   help="Most sampling waves per rollout when filters drop groups.")
    g.add_argument("--micro-batch-size", type=int, default=1,
                   help="Samples per micro-batch per device (ignored under --use-dynamic-batch-size). "
                        "Not given: micro-batches are packed by tokens (--max-tokens-per-gpu, default 8192).")
    g.add_argument("--balance-data", action="store_true",
                   help="Spread micro-batches over data-parallel ranks by token count (Karmarkar-Karp).")
    g.add_argument("--rollout-max-context-len", type=int, default=None, help="Cap on prompt + response tokens.")
    g.add_argument("--rollout-max-prompt-len", type=int, default=None,
                   help="Drop longer prompts at load (default: --rollout-max-context-len - 1 when that is set).")
    g.add_argument("--disable-rollout-global-dataset", action="store_true",
                   help="No prompt dataset: the rollout function makes its own samples.")
    g.add_argument("--rollout-temperature", type=float, default=1.0,
                   help="Sampling temperature (> 0); the trainer divides logits by it too.")
    g.add_argument("--rollout-top-p", type=float, default=1.0, help="Nucleus sampling probability mass, in (0, 1].")
    g.add_argument("--rollout-top-k", type=int, default=-1, help="Top-k sampling (-1 = off).")
    g.add_argument("--rollout-max-response-len", type=int, default=None, help="Most new tokens per response (unset: the engine's own default, 128 for SGLang and the embedded engine).")
    g.add_argument("--rollout-stop", nargs="+", default=None, help="Stop strings (default: the model's).")
    g.add_argument("--rollout-stop-token-ids", nargs="+", type=int, default=None, help="Stop token ids.")
    g.add_argument("--rollout-skip-special-tokens", action="store_true",
                   help="Detokenize responses without special tokens.")
