"""Regenerate the Hugging Face fixtures of tests/test_hf.py (run by hand; needs torch and
transformers, which CI does not install):

    pip install torch transformers safetensors
    python tests/data/hf/make_fixtures.py

For each architecture plait imports it writes a tiny random-weight model into
tests/data/hf/<name>/ (config.json + model.safetensors, a few tens of KB) and
expected.npz: input ids, the float32 logits `transformers` computes for them, a
prompt and the greedy continuation `generate` makes. Every weight is drawn at
random (biases and norm scales included, which transformers would otherwise
initialise to 0 and 1), so a wrong bias or norm shows in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers as tf

HERE = Path(__file__).parent
VOCAB = 300  # not a multiple of 128: plait pads the vocabulary, the logits must not see it

MODELS = {
    "gpt2": tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64),
    # GQA (2 kv heads for 4), Llama 3.1's rotary scaling with a short original context so
    # every band of the scaling (kept, interpolated, stretched) is used at head size 16.
    "llama3": tf.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=64,
        rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    # multi-query attention (one kv head), no sliding window
    "mistral": tf.MistralConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
        sliding_window=None, tie_word_embeddings=False, rope_theta=10000.0),
    # q/k/v biases, tied embeddings
    "qwen2": tf.Qwen2Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
        tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False),
    # a mixture of experts: 4 SwiGLU experts, 2 per token, in every layer
    "mixtral": tf.MixtralConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        tie_word_embeddings=False, rope_theta=1000000.0),
    # Qwen2-MoE: q/k/v biases, 4 experts of 48, 2 per token with their probabilities as
    # they are (no renormalisation), a shared expert of 40 behind its sigmoid gate
    "qwen2_moe": tf.Qwen2MoeConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=64, moe_intermediate_size=48, shared_expert_intermediate_size=40,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], vocab_size=VOCAB, max_position_embeddings=64,
        tie_word_embeddings=False, rope_theta=1000000.0, use_sliding_window=False),
    # OLMoE: RMS norms over the whole query and key projections (grouped-query here, 2 kv
    # heads), 4 experts of 48, 2 per token, probabilities as they are
    "olmoe": tf.OlmoeConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False,
        rope_theta=10000.0),
}


def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            is_norm = "norm" in name or "ln_" in name
            p.copy_(1.0 + noise if is_norm and name.endswith("weight") else noise * 2)


def tokenizer(path: Path) -> None:
    """A byte-level BPE of VOCAB ids (Llama 3's end-of-text token among them), trained on a
    fixed text, so the README's fine-tuning workflow runs with the model's own tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = ["the", "mesh", "model", "layer", "device", "train", "step", "data", "token",
             "batch", "pipeline", "tensor", "parallel", "checkpoint", "resume", "plait",
             "shard", "axis"]
    text = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


# A chat template in the form Hugging Face keeps it (tokenizer_config.json), over text the
# tiny tokenizer has and its end-of-text token: `plait data --chat` and `plait sample
# --chat` read it from the run `plait import` makes (README, tests/test_chat.py).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<' + message['role'] + '>\\n' + message['content'] | trim + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>\\n' }}{% endif %}")


def tokenizer_config(path: Path) -> None:
    path.write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|end_of_text|>", "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    for name, config in MODELS.items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        randomise(model, gen)
        out = HERE / name
        out.mkdir(exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
        with torch.no_grad():
            logits = model(ids).logits.float().numpy()
            prompt = ids[:1, :5]
            cont = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                  max_new_tokens=8, do_sample=False, pad_token_id=0)
        np.savez(out / "expected.npz", ids=ids.numpy(), logits=logits,
                 prompt=prompt.numpy()[0], continuation=cont.numpy()[0, 5:])
        for extra in ("generation_config.json",):
            (out / extra).unlink(missing_ok=True)
        if name == "llama3":
            tokenizer(out / "tokenizer.json")
            tokenizer_config(out / "tokenizer_config.json")
        print(name, json.loads((out / "config.json").read_text())["architectures"],
              logits.shape, cont.numpy()[0, 5:])


if __name__ == "__main__":
    main()
