"""The embedded default: a tiny model, a character tokenizer and an arithmetic task.

Nothing can be downloaded on the machines rlserve starts on, so the default run builds
everything it needs locally, in standard Hugging Face formats (a real transformers Llama
saved as safetensors, a `tokenizers` tokenizer saved with PreTrainedTokenizerFast), and a
verifiable task whose rule reward is exact match. Real users point the same code at their
own model directory and dataset instead.
"""
