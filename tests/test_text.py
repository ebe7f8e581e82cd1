"""Text tower: [CLS] pooling under the mask, tokenizers (trained and MiniLM), the MiniLM -> DistilBERT mapping."""
import pytest
import torch

from clip_mini.config import TextConfig
from clip_mini.model.text import (MINILM, TextEncoder, build_tokenizer, load_tokenizer, minilm_dir, minilm_to_distilbert,
                            train_tokenizer)

CAPTIONS = [
    "A black dog is running through the grass .",
    "Two children play on the beach near the water",
    "a man in a red shirt climbs a rock wall",
    "A girl with a pink umbrella walks down the street .",
    "the brown dog jumps over a fence",
]


def test_trained_tokenizer_knows_caption_words_and_wraps_cls_sep(tmp_path):
    tok = train_tokenizer(CAPTIONS * 3, vocab_size=500)
    enc = tok(["a black dog runs on the beach", "a girl in a red shirt"], padding="longest", return_tensors="pt")
    ids = enc["input_ids"]
    assert (ids != tok.unk_token_id).all() or (ids[enc["attention_mask"] == 1] != tok.unk_token_id).all()
    assert (ids[:, 0] == tok.cls_token_id).all()
    lengths = enc["attention_mask"].sum(1)
    assert all(ids[i, lengths[i] - 1] == tok.sep_token_id for i in range(len(ids)))
    assert tok.convert_ids_to_tokens(ids[0, 1:4].tolist()) == ["a", "black", "dog"]  # lower-cased words kept
    tok.save_pretrained(str(tmp_path))
    again = load_tokenizer(tmp_path)
    assert again(["a black dog"])["input_ids"] == tok(["a black dog"])["input_ids"]


def test_cls_state_ignores_padding():
    torch.manual_seed(0)
    tok = train_tokenizer(CAPTIONS, vocab_size=300)
    enc = TextEncoder(TextConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, dropout=0.0), len(tok)).eval()
    short = tok(["a dog"], return_tensors="pt")
    padded = tok(["a dog", "a man in a red shirt climbs a rock wall"], padding="longest", return_tensors="pt")
    assert padded["input_ids"].shape[1] > short["input_ids"].shape[1]
    a = enc(short["input_ids"], short["attention_mask"])
    b = enc(padded["input_ids"], padded["attention_mask"])[:1]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # position 0 really is the output: it is the final state there, a later token changes it, and the same
    # tokens again give the same output
    hidden = enc.bert(**short).last_hidden_state
    torch.testing.assert_close(a, hidden[:, 0])
    torch.testing.assert_close(enc(short["input_ids"], short["attention_mask"]), a, atol=0, rtol=0)
    other = short["input_ids"].clone()
    other[0, 2] = tok.convert_tokens_to_ids("girl")   # "a dog" -> "a girl"
    assert short["input_ids"][0, 2] == tok.convert_tokens_to_ids("dog") != other[0, 2] != tok.unk_token_id
    assert (enc(other, short["attention_mask"]) - a).abs().max() > 1e-3


def test_frozen_text_tower_has_no_trainable_params():
    from clip_mini.config import ModelConfig
    from clip_mini.model.clip import CLIPModel

    cfg = ModelConfig(text=TextConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64, trainable=False))
    model = CLIPModel.build(cfg, captions=CAPTIONS)
    from clip_mini.model.clip import apply_trainable

    apply_trainable(model)
    assert not any(p.requires_grad for p in model.text.parameters())
    assert all(p.requires_grad for p in model.visual.parameters())


def test_minilm_tokenizer_is_bert_uncased_and_not_unk():
    tok = build_tokenizer(TextConfig(pretrained=MINILM))
    assert len(tok) == 30522
    ids = tok(["A dog runs on the grass"])["input_ids"][0]
    assert tok.unk_token_id not in ids
    assert tok.convert_ids_to_tokens(ids) == ["[CLS]", "a", "dog", "runs", "on", "the", "grass", "[SEP]"]


def test_minilm_mapping_matches_bert_hidden_states():
    from transformers import BertModel

    bert = BertModel.from_pretrained(str(minilm_dir())).eval()
    tok = build_tokenizer(TextConfig(pretrained=MINILM))
    enc = TextEncoder(TextConfig(pretrained=MINILM, dropout=0.0), len(tok), tok.pad_token_id).eval()
    enc.load_pretrained(MINILM)
    batch = tok(CAPTIONS, padding="longest", return_tensors="pt")
    with torch.no_grad():
        want = bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        got = enc.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    mask = batch["attention_mask"].bool()
    assert (got[mask] - want[mask]).abs().max().item() < 1e-4
    assert len(minilm_to_distilbert(minilm_dir())) == len(enc.bert.state_dict())


@pytest.mark.parametrize("cls_input", ["zero", "embedding", "auto"])
def test_cls_input_zero_makes_the_cls_state_depend_on_the_caption(cls_input):
    # A from-scratch post-norm DistilBERT's [CLS] state is nearly constant at init (its own embedding dominates the
    # tiny attention read-out); cls_input="zero" ("auto" from scratch) feeds [CLS] in as a zero vector, so its first
    # attention reads the caption out.
    from clip_mini.config import ModelConfig
    from clip_mini.model.clip import CLIPModel

    tok = train_tokenizer(CAPTIONS * 3, vocab_size=500)
    cfg = ModelConfig(text=TextConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.0, pooling="cls",
                                      cls_input=cls_input))   # two blocks: "auto" means zero
    torch.manual_seed(0)
    model = CLIPModel(cfg, vocab_size=len(tok), pad_token_id=tok.pad_token_id, tokenizer=tok).eval()
    enc = tok(CAPTIONS, padding="longest", return_tensors="pt")
    with torch.no_grad():
        embedded = model.text.bert.embeddings(enc["input_ids"])                   # (B, L, dim), hooks applied
        cls = model.text(enc["input_ids"], enc["attention_mask"])                 # (B, dim)
    spread = (cls - cls.mean(0)).norm(dim=1).mean() / cls.norm(dim=1).mean()      # how much captions differ
    assert embedded[:, 1:].abs().min(dim=-1).values.max() > 0                     # the words are untouched
    if cls_input in ("zero", "auto"):
        assert embedded[:, 0].abs().max() == 0
        assert spread > 0.3
    else:
        assert embedded[:, 0].abs().max() > 0.1
        assert spread < 0.1


@pytest.mark.parametrize("n_layers, pretrained, zeroed", [(2, None, True), (1, None, False), (2, "some/dir", False)])
def test_cls_input_auto_zeroes_only_a_from_scratch_tower_of_two_or_more_blocks(n_layers, pretrained, zeroed):
    from clip_mini.model.text import TextEncoder

    enc = TextEncoder(TextConfig(dim=64, n_layers=n_layers, n_heads=4, hidden_dim=128, pretrained=pretrained), 100)
    ids = torch.tensor([[2, 7, 8, 3]])
    assert (enc.bert.embeddings(ids)[:, 0].abs().max() == 0) == zeroed


def _kernel_test_tower():
    torch.manual_seed(0)
    tok = train_tokenizer(CAPTIONS, vocab_size=300)
    enc = TextEncoder(TextConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, dropout=0.0), len(tok)).eval()
    # padded: the two kernels' masks differ in format (eager: additive floats; sdpa: booleans or none)
    return enc, dict(tok(CAPTIONS, padding="longest", return_tensors="pt"))


def _kernel_of(mode) -> str:
    from clip_mini.model.layers.dropout import register_eager_attention

    return "sdpa" if mode is torch.inference_mode else register_eager_attention()


@pytest.mark.parametrize("outer, inner", [(torch.no_grad, torch.inference_mode), (torch.inference_mode, torch.no_grad),
                                          (torch.enable_grad, torch.inference_mode)])
def test_a_text_pass_keeps_its_attention_kernel_while_another_thread_runs_the_tower(outer, inner):
    """One model serves several threads (``clip-mini serve``: match maps beside searches): transformers reads the
    attention kernel from the config every layer shares, so a pass under inference_mode (fused) in another thread
    must not switch a CPU pass without it (plain) midway, nor the reverse. Each pass's layers run the kernel its own
    thread picked, and its output equals the same pass run alone, bit for bit."""
    import threading

    enc, batch = _kernel_test_tower()

    def run(mode):
        with mode():
            return enc(**batch).detach().clone()

    alone = {outer: run(outer), inner: run(inner)}
    seen: dict = {}   # (thread, layer) -> the kernel that layer's attention read
    outer_thread, other = threading.get_ident(), {}

    def record(layer):
        def hook(_module, _args):
            seen.setdefault((threading.get_ident(), layer), enc.bert.config._attn_implementation)
        return hook

    def inner_pass():
        try:
            other["features"] = run(inner)
            other["thread"] = threading.get_ident()
        except Exception as err:   # noqa: BLE001 - reported by the assertion below
            other["error"] = err

    def midway(_module, _args):   # the outer pass's mask is built and its first layer is about to run
        if threading.get_ident() == outer_thread and not other:
            t = threading.Thread(target=inner_pass)
            t.start()
            t.join()

    layers = enc.bert.transformer.layer
    handles = [layers[0].register_forward_pre_hook(midway)]
    handles += [layer.attention.register_forward_pre_hook(record(i)) for i, layer in enumerate(layers)]
    try:
        mid = run(outer)
    finally:
        for h in handles:
            h.remove()
    assert "error" not in other, other.get("error")
    assert {i: seen[(outer_thread, i)] for i in range(len(layers))} == {i: _kernel_of(outer) for i in range(len(layers))}
    assert {i: seen[(other["thread"], i)] for i in range(len(layers))} == {i: _kernel_of(inner) for i in range(len(layers))}
    assert torch.equal(mid, alone[outer])
    assert torch.equal(other["features"], alone[inner])


def test_text_passes_from_many_threads_equal_their_single_threaded_results():
    """Text passes under inference_mode, no_grad and with a graph from many threads at once: each equals what the
    same pass gives on its own, bit for bit (each thread's kernel choice holds for its own passes only)."""
    import threading

    enc, batch = _kernel_test_tower()
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]

    def run(mode, inputs):
        with mode():
            return enc(**inputs).detach().clone()

    jobs = [lambda m=m, x=x: run(m, x) for m in (torch.inference_mode, torch.no_grad, torch.enable_grad)
            for x in (batch, *halves)] * 2
    alone = [job() for job in jobs]
    for _ in range(4):
        results, errors = [None] * len(jobs), []
        start = threading.Barrier(len(jobs))

        def work(k):
            try:
                start.wait()
                results[k] = jobs[k]()
            except Exception as err:   # noqa: BLE001 - reported by the assertion below
                errors.append(err)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        differ = [k for k in range(len(jobs)) if not torch.equal(results[k], alone[k])]
        assert not differ, f"passes {differ} of {len(jobs)} differ from their single-threaded results"


def _mixed_length_batch(tok, n=100):
    """n captions from 2 to ~25 words, shuffled: a batch whose longest caption pads most of the rest."""
    words = "a black dog is running through the tall green grass near two children on a sunny beach".split()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, len(words) + 1, (n,), generator=g).tolist()
    lengths[7] = len(words)
    return tok([" ".join(words[:k]) for k in lengths], padding="longest", return_tensors="pt")


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_length_buckets_give_the_rows_and_gradients_of_one_padded_pass(pooling, monkeypatch):
    import clip_mini.model.text as text
    torch.manual_seed(0)
    tok = train_tokenizer(CAPTIONS * 3, vocab_size=300)
    enc = TextEncoder(TextConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, dropout=0.0, pooling=pooling), len(tok))
    batch = _mixed_length_batch(tok)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    order, cuts = text.length_buckets(mask, rows=32)
    assert sum(cuts) == len(ids) and cuts == [32, 32, 36]
    assert text._bucket_lengths(mask, order, cuts)[-1] == ids.shape[1] > text._bucket_lengths(mask, order, cuts)[0]

    def rows_and_grads(bucketed: bool):
        monkeypatch.setattr(text, "BUCKET_MIN_SAVING", 0.0 if bucketed else 2.0)   # 2.0: never worth it
        enc.zero_grad(set_to_none=True)
        out = enc(ids, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}

    calls = []
    real = enc._pooled
    monkeypatch.setattr(enc, "_pooled", lambda i, m: calls.append(i.shape) or real(i, m))
    one, one_grads = rows_and_grads(False)
    assert len(calls) == 1
    calls.clear()
    many, many_grads = rows_and_grads(True)
    assert len(calls) == 3 and calls[0][1] < ids.shape[1]            # three passes, the shortest cut short
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-5)
    assert many_grads.keys() == one_grads.keys()
    scale = max(g.abs().max().item() for g in one_grads.values())   # fp32 sums over ~1,000 tokens: noise at it
    for name in one_grads:   # (keys' biases get zero gradients, as noise: the same absolute tolerance)
        torch.testing.assert_close(many_grads[name], one_grads[name], rtol=1e-3, atol=1e-4 * scale,
                                   msg=lambda m: f"{name}: {m}")


def test_length_buckets_skip_small_even_or_left_padded_batches():
    from clip_mini.model.text import length_buckets
    tok = train_tokenizer(CAPTIONS * 3, vocab_size=300)
    mask = _mixed_length_batch(tok)["attention_mask"]
    assert length_buckets(mask[:40], rows=32) is None                    # under two buckets
    assert length_buckets(torch.ones(100, 12, dtype=torch.long)) is None  # nothing padded to save
    assert length_buckets(mask.flip(1)) is None                          # left padding: never cut from the right
    assert length_buckets(mask, min_saving=0.99) is None                 # not worth it
