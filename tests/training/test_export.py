"""`gpipe export --hf` and `gpipe sample` on a run's checkpoint: the exported folder loads with
`from_pretrained` and computes what the run computed (its logits, its last validation loss),
with the run's tokenizer beside it; `gpipe sample` generates from any run's model; and each
bad input is one line and exit code 2.

One tiny run (a 2-layer Llama whose head is tied to its embedding, on text through a
tokenizer.json, 2 stages) serves every test but GPT-NeoX's, which saves its weights under other
names than its modules'; checkpoints of runs that need no training are written directly.
"""

import json
import sys
import warnings

import pytest
import torch
from torch import nn

from gpipe.cli import main
from gpipe.data import BatchSampler
from gpipe.models.gpt import lm_loss
from gpipe.training.checkpoints.format import save_checkpoint
from gpipe.training.checkpoints.manifest import digest, listed_files, write_manifest
from gpipe.training.checkpoints.safe_reading import load_state
from gpipe.training.data.run_data import run_dataset
from gpipe.training.models.trained import checkpoint_at, load_trained
from gpipe.training.options import TrainOptions

from ..text_cases import LINES, llama_config, word_tokenizer
from ..workers import training_on_shared_processes

transformers = pytest.importorskip(
    "transformers", reason="gpipe export --hf and --model hf: need Hugging Face transformers"
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two steps of a 2-layer Llama with a tied head on 2 stages (the embedding on the
    first, the head on the last), evaluated at the last; text tokenized by a tokenizer.json."""
    folder = tmp_path_factory.mktemp("export")
    config = llama_config(folder / "llama", 32, 32)
    config.write_text(json.dumps({**json.loads(config.read_text()), "tie_word_embeddings": True}))
    (folder / "text.txt").write_text("\n".join(LINES * 40))
    out = folder / "run"
    args = [
        "train", "--model", f"hf:{folder / 'llama' / 'config.json'}",
        "--data", str(folder / "text.txt"), "--tokenizer", str(word_tokenizer(folder / "t.json")),
        "--stages", "2", "--steps", "2", "--seq-len", "16", "--batch-size", "4", "--chunks", "2",
        "--eval-every", "2", "--sample-tokens", "2", "--threads", "1", "--quiet", "--out", str(out),
    ]  # fmt: skip
    with training_on_shared_processes():
        assert main(args) == 0
    return out


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "llama"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    return out


def _usage_error(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("gpipe: error: ")
    return err


def test_the_folder_is_save_pretrained_layout_with_the_runs_tokenizer(exported):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not [p for p in exported.parent.iterdir() if p.name.startswith(".")]  # no leftovers
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "llama" and config["use_cache"] is True
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert (
        tokenizer("the dog sat")["input_ids"]
        == tokenizer.backend_tokenizer.encode("the dog sat").ids
    )


def test_from_pretrained_computes_the_logits_of_the_checkpoint(run, exported):
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    trained = load_trained(checkpoint_at(run))
    initial = transformers.AutoModelForCausalLM.from_pretrained(run / "initial")
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(logits, trained.logits(ids))
        assert not torch.allclose(logits, initial.eval()(ids).logits)  # trained, not as drawn


def test_from_pretrained_computes_the_runs_last_validation_loss(run, exported):
    """The loss of the run's evaluation (StageRun.evaluate: the first ``eval_batches``
    batches of the held-out tokens, drawn from ``seed + 1``) through the exported model."""
    train = json.loads((run / "run.json").read_text())["train"]
    opts = TrainOptions(**train)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    val = BatchSampler(
        run_dataset(opts, run).val, opts.batch_size, opts.seq_len, seed=opts.seed + 1
    )
    losses = []
    with torch.no_grad():
        for _ in range(opts.eval_batches):
            x, y = val.next()
            losses.append(float(lm_loss(model(x).logits, y)))
    assert sum(losses) / len(losses) == pytest.approx(last["val_loss"], rel=1e-6, abs=1e-6)


def test_a_gpt_neox_starts_from_its_saved_weights_and_exports_them_back(tmp_path):
    """GPT-NeoX saves its lm_head as embed_out: the stages read it back under the module's
    name and the export writes it under the saved one. With a learning rate of 0, the
    exported model is the one the run started from, tensor for tensor."""
    config = transformers.GPTNeoXConfig(
        vocab_size=256,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    config.save_pretrained(tmp_path / "neox")
    run, out = tmp_path / "run", tmp_path / "exported"
    args = [
        "train", "--model", f"hf:{tmp_path / 'neox' / 'config.json'}", "--stages", "2",
        "--steps", "1", "--lr", "0", "--seq-len", "16", "--batch-size", "4", "--chunks", "2",
        "--eval-every", "1", "--sample-tokens", "1", "--threads", "1", "--quiet", "--out", str(run),
    ]  # fmt: skip
    with training_on_shared_processes():
        assert main(args) == 0
    assert main(["export", str(run), "--hf", str(out)]) == 0
    initial = transformers.AutoModelForCausalLM.from_pretrained(run / "initial").state_dict()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    trained = load_trained(checkpoint_at(run)).original.state_dict()
    assert set(exported) == set(initial) == set(trained)
    for name, tensor in exported.items():
        assert torch.equal(tensor, trained[name]) and torch.equal(tensor, initial[name]), name


def test_a_tied_head_counts_once_in_the_gradient_norm_as_without_the_pipeline(run, exported):
    """The run's first step clipped by the norm of the unsplit model's gradients: the tied
    embedding and head, two copies on two stages, are one weight (its norm counted the copies
    twice, so the clipped update and every loss after it differed from one stage's). The
    export holds the weight once, and the checkpoint's copies are still equal."""
    train = json.loads((run / "run.json").read_text())["train"]
    opts = TrainOptions(**train)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "initial")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    x, y = BatchSampler(
        run_dataset(opts, run).train, opts.batch_size, opts.seq_len, seed=opts.seed
    ).next()
    lm_loss(model(x).logits, y).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert first["step"] == 1 and first["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    copies = {
        "0.model.embed_tokens.weight": torch.zeros(32, 32),
        "1.lm_head.weight": torch.ones(32, 32),
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        load_state({"model": copies}, checkpoint_at(run), no_dist=True)
    assert torch.equal(*copies.values())
    saved = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert saved.lm_head.weight is saved.model.embed_tokens.weight


def test_sample_draws_again_the_runs_own_sample_with_its_tokenizer(run, capsys):
    """The run ends with a sample of its prompt, seed and tokenizer; `gpipe sample` with the
    same reads the same weights and draws the same words."""
    assert main(["sample", str(run), "--prompt", "def ", "--tokens", "2"]) == 0
    assert capsys.readouterr().out == (run / "sample.txt").read_text() + "\n"
    assert main(["sample", str(run), "--prompt", "the cat", "--tokens", "6"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:2] == ["the", "cat"] and len(words) > 2  # special tokens decode to nothing
    assert set(words) <= {w for line in LINES for w in line.split()} | {"[UNK]", "<|endoftext|>"}


def test_sample_checks_model_against_the_run(run, capsys):
    llama = json.loads((run / "run.json").read_text())["model"]["hf_config"]
    folder = llama.removesuffix("/config.json")
    assert main(["sample", str(run), "--model", f"hf:{folder}", "--tokens", "1"]) == 0
    message = _usage_error(capsys, "sample", run, "--model", "gpt")
    assert f"--model gpt: the checkpoint {run}/checkpoints/step-000002 holds --model hf:" in message


def _checkpoint(root, model: nn.Module, description: dict):
    """A checkpoint of ``model`` with ``description``, as a run of it would write."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = {"seed": 0, "seq_len": 8, "tokenizer": None}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        return save_checkpoint(
            root / "checkpoints", 1, model, optimizer, {}, {"train": train, **description}
        )


def test_sample_generates_from_a_factorys_sequential(tmp_path, monkeypatch, capsys):
    (tmp_path / "bigram.py").write_text(
        "from torch import nn\n\n"
        "def make():\n"
        "    return nn.Sequential(nn.Embedding(256, 16), nn.Linear(16, 256))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "bigram", raising=False)
    model = nn.Sequential(nn.Embedding(256, 16), nn.Linear(16, 256))
    with torch.no_grad():
        model[1].bias.fill_(-1e4)
        model[1].bias[ord("a")] = 0  # every next byte is "a"
    meta = {"source": "bigram:make", "vocab_size": 256, "seq_len": 8}
    run = _checkpoint(tmp_path / "run", model, {"model": meta}).parent.parent
    # the checkpoint names code to run: it runs only when the user names it too
    message = _usage_error(capsys, "sample", run, "--prompt", "b")
    assert "names code to run, --model bigram:make" in message
    args = ["sample", str(run), "--model", "bigram:make", "--prompt", "b", "--tokens", "4"]
    assert main(args) == 0
    assert capsys.readouterr().out == "baaaa\n"
    sys.modules.pop("bigram", None)


def test_export_of_a_run_without_a_hugging_face_model_says_what_it_trained(tmp_path, capsys):
    from gpipe.models.gpt import PRESETS, build_gpt

    config = PRESETS["tiny"]
    gpt = _checkpoint(tmp_path / "gpt", build_gpt(config), {"model": config.to_dict()})
    message = _usage_error(capsys, "export", gpt, "--hf", tmp_path / "out")
    assert "the run trains the built-in GPT (--model gpt), not a Hugging Face model" in message
    own = {"source": "mine:build", "vocab_size": 4, "seq_len": 8}
    path = _checkpoint(tmp_path / "own", nn.Linear(2, 2), {"model": own})
    message = _usage_error(capsys, "export", path.parent.parent, "--hf", tmp_path / "out")
    assert "--model mine:build, a module of your own" in message
    assert "nothing to export to Hugging Face" in message
    assert not (tmp_path / "out").exists()


def _edited(checkpoint, edit) -> None:
    """The checkpoint's record edited, its manifest made to match (what a tamperer does)."""
    record = json.loads((checkpoint / "gpipe.json").read_text())
    edit(record)
    (checkpoint / "gpipe.json").write_text(json.dumps(record))
    write_manifest(checkpoint, {n: digest(checkpoint / n) for n in listed_files(checkpoint)})


def _no_launch(*_, **__):
    raise AssertionError("processes were started")


def test_a_record_declaring_more_stages_than_its_tensors_starts_no_process(
    run, tmp_path, capsys, monkeypatch
):
    """``gpipe sample`` and ``generate`` start a process for each stage the record's balance
    declares: a record edited to declare 4096, its counts and cuts made to match (the GPT's
    layers, a split model's cut points), is refused, naming the file and the field, before
    any starts."""
    import shutil

    import gpipe.training.launch
    from gpipe.models.gpt import PRESETS, build_gpt

    monkeypatch.setattr(gpipe.training.launch, "launch", _no_launch)
    copy = tmp_path / "run"
    shutil.copytree(checkpoint_at(run), copy / "checkpoints" / "step-000002")
    layers = [f"model.layers.{i % 2}" for i in range(4095)]
    record = {"balance": [1] * 4096, "stages": 4096}
    _edited(checkpoint_at(copy), lambda r: r.update(record) or r["model"].update(split_at=layers))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"ids": [1, 2]}\n')
    said = "gpipe.json's balance declares 4096 stages, but its tensors hold the weights of 2"
    assert said in _usage_error(capsys, "sample", copy, "--tokens", "1")
    argv = ["generate", copy, "--prompts", prompts, "--out", tmp_path / "o.jsonl"]
    assert said in _usage_error(capsys, *argv, "--max-new-tokens", "1", "--quiet")
    config = PRESETS["tiny"]
    gpt = _checkpoint(tmp_path / "gpt", build_gpt(config), {"model": config.to_dict()})
    wide = {**config.to_dict(), "n_layer": 4094}
    _edited(gpt, lambda r: r.update(model=wide, balance=[1] * 4096, stages=4096))
    said = "gpipe.json's balance cuts 4096 layers, but its tensors hold the weights of 4"
    assert said in _usage_error(capsys, "sample", gpt, "--tokens", "1")


def test_export_refuses_no_checkpoint_a_damaged_one_and_a_full_folder(run, tmp_path, capsys):
    import shutil

    message = _usage_error(capsys, "export", tmp_path, "--hf", tmp_path / "out")
    assert f"{tmp_path}: no gpipe checkpoint there" in message
    damaged = tmp_path / "step-000002"
    shutil.copytree(checkpoint_at(run), damaged)
    data = next(damaged.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    message = _usage_error(capsys, "export", damaged, "--hf", tmp_path / "out")
    assert f"{damaged}: damaged checkpoint (" in message
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    message = _usage_error(capsys, "export", run, "--hf", tmp_path / "full")
    assert "exists and is not empty; pass --force to replace it" in message
    assert main(["export", str(run), "--hf", str(tmp_path / "full"), "--force"]) == 0
    assert "model.safetensors" in {p.name for p in (tmp_path / "full").iterdir()}
    assert not (tmp_path / "full" / "notes.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_tokenizer_folder_gives_its_tokenizer_files_only(tmp_path):
    from tokenizers import Tokenizer

    from gpipe.training.hf.export import tokenizer_files

    raw = Tokenizer.from_file(str(word_tokenizer(tmp_path / "t.json")))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "model")
    for other in ("config.json", "model.safetensors", "generation_config.json"):
        (tmp_path / "model" / other).write_text("{}")
    names = set(tokenizer_files(tmp_path / "model"))
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    assert not names & {"config.json", "model.safetensors", "generation_config.json"}
    assert tokenizer_files(tmp_path / "t.json") == {"tokenizer.json": tmp_path / "t.json"}


def test_a_record_that_names_another_file_as_its_tokenizer_is_refused(tmp_path):
    """The tokenizer's path comes from the run's record: one that names a key file (a
    tampered record) is read as a tokenizer and refused, never copied into the export."""
    from gpipe.training.hf.export import tokenizer_files

    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nSECRET\n")
    with pytest.raises(ValueError, match=r"^--tokenizer .*id_rsa: not a tokenizer\.json"):
        tokenizer_files(secret)
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "tokenizer_config.json").write_text('{"tokenizer_class": 7}')
    with pytest.raises(ValueError, match=r"^--tokenizer .*keys: no Hugging Face tokenizer"):
        tokenizer_files(tmp_path / "keys")
