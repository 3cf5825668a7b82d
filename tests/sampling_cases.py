"""sample_tokens cases each stack's tests run: sharded logits' rows and arguments (SPMD on both
stacks, DTensors), and transformers' generate(do_sample=True) with torch_pallas.SeededSampling
(docs/sampling.md): a prompt's continuation is the same generated alone, in a batch of 9 prompts
and left-padded."""

import torch

import torch_pallas


def sharded_logits_case(vocabulary: int = 1000):
    """(8, vocabulary) logits (two rows of ties, across shards too) and sample_tokens' arguments:
    every parameter, a greedy row, positions up to 2**32 - 1, log-probabilities."""
    values = torch.randn(8, vocabulary, generator=torch.Generator().manual_seed(3)) * 3
    values[:2] = values[:2].round()
    arguments = dict(seeds=list(range(100, 108)), positions=[0, 1, 2, 2**31, 7, 7, 9, 2**32 - 1],
                     temperature=torch.tensor([0.8, 0.0, 1.0, 1.3, 0.8, 0.5, 0.0, 2.0]), top_k=50, top_p=0.9,
                     min_p=0.01, return_logprobs=True)
    return values, arguments


def tiny_gpt2(device, attention="sdpa"):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=299, pad_token_id=299, attn_implementation=attention)
    return transformers.GPT2LMHeadModel(config).eval().to(device)


def check_continuations_alike_alone_in_a_batch_and_left_padded(device, attention="sdpa") -> None:
    """A tiny GPT-2's float32 logits for a prompt are the same alone and left-padded in a batch of
    9 to within rounding (checked: the first step's, within 1e-5), so its tokens are the same
    unless two scores tie that closely."""
    model = tiny_gpt2(device, attention)
    assert model.config._attn_implementation == attention
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 299, (int(length),), generator=generator) for length in torch.randint(2, 12, (9,),
                                                                                                     generator=generator)]
    seeds = list(range(100, 109))

    def generate(indices):
        width = max(len(prompts[i]) for i in indices)
        ids = torch.full((len(indices), width), 299)
        mask = torch.zeros(len(indices), width, dtype=torch.long)
        for row, i in enumerate(indices):  # left padding
            ids[row, width - len(prompts[i]):] = prompts[i]
            mask[row, width - len(prompts[i]):] = 1
        sampling = torch_pallas.SeededSampling([seeds[i] for i in indices], temperature=1.0, top_p=0.9)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                             max_new_tokens=8, min_new_tokens=8, logits_processor=[sampling])
        return {i: out[row, width:].cpu().tolist() for row, i in enumerate(indices)}
    batch = generate(list(range(9)))
    assert len({tuple(tokens) for tokens in batch.values()}) > 1
    for i in (0, 4, 8):
        assert generate([i])[i] == batch[i], i
    assert generate([8, 0])[0] == batch[0]
    with torch.no_grad():  # the logits' batch invariance the comparison relies on
        alone = model(prompts[3][None].to(device)).logits[0, -1].cpu()
        width = max(map(len, prompts))
        padded = torch.cat([torch.full((width - len(prompts[3]),), 299), prompts[3]])[None]
        mask = (torch.arange(width) >= width - len(prompts[3])).long()[None]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded positions
        in_batch = model(padded.to(device), attention_mask=mask.to(device),
                         position_ids=positions.to(device)).logits[0, -1].cpu()
    torch.testing.assert_close(in_batch, alone, rtol=0, atol=1e-5)
