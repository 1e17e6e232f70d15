"""`gpipe plan --cluster`: one layout's prediction as lines or JSON, --search's table and
command, and bad input in one line each."""

import json
import re

import pytest

from gpipe.cli import main

GPT = [
    "plan",
    "--cluster",
    "64xA100-80GB",
    "--n-layer",
    "16",
    "--d-model",
    "2048",
    "--n-head",
    "16",
    "--vocab-size",
    "51200",
    "--seq-len",
    "2048",
]


def _json(capsys, *args: str) -> dict:
    assert main([*GPT, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_issues_keys(capsys):
    got = _json(capsys, "--tensor-parallel", "2", "--stages", "4", "--global-batch", "256")
    for key in ("step_time_s", "tflops_per_gpu", "mfu", "memory_per_gpu_gib"):
        assert got[key] > 0, key
    assert got["layout"]["data_parallel"] == 8 and got["layout"]["microbatches"] == 32
    parts = got["memory_gib"]
    assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"])
    assert got["memory_per_gpu_gib"] == pytest.approx(parts["total"]) and got["fits"]


def test_the_lines_give_time_rates_and_memory_by_part(capsys):
    args = ["--tensor-parallel", "2", "--stages", "4", "--global-batch", "256"]
    assert main([*GPT, *args, "--schedule", "interleaved", "--recompute", "full"]) == 0
    out = capsys.readouterr().out
    for text in (
        "step time",
        "teraFLOP/s per GPU",
        "MFU",
        "memory per GPU",
        "weights",
        "gradients",
        "optimizer",
        "activations",
        "buffers",
    ):
        assert text in out, text
    # the interleaved schedule's stages per process are the planner's: it says which
    assert "stages per process: 2, the fastest that fits of 2, 4" in out


def test_a_hugging_face_config_is_read_for_its_shapes(tmp_path, capsys):
    config = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = ["plan", "--cluster", "16xH100-SXM", "--model", f"hf:{path}", "--global-batch", "64"]
    assert main([*args, "--tensor-parallel", "4", "--recompute", "full", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["layout"]["seq_len"] == 8192 and got["model"]["parameters"] == pytest.approx(
        8.0e9, rel=0.01
    )


def _train_command(out: str) -> list[str]:
    """The search's ``gpipe train`` command, as its arguments."""
    found = re.search(r"^run the fastest(?: gpipe trains)?: gpipe (train .*)$", out, re.M)
    assert found, out
    return found[1].split()


def _trains(command: list[str], capsys) -> None:
    """``gpipe train`` takes the command as given (its checks, not a run: on this machine's
    CPU, writing out the configuration instead)."""
    device = command.index("--device")
    assert (
        main([*command[:device], "--device", "cpu", *command[device + 2 :], "--print-config"]) == 0
    )
    capsys.readouterr()


def test_search_prints_the_fastest_why_the_others_do_not_and_a_command(capsys):
    assert main([*GPT, "--dropout", "0", "--global-batch", "256", "--search", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts searched" in out and "why the others were left:" in out
    assert "fit, but slower" in out
    table = out.split("\n")[1:5]
    assert table[0].split()[:4] == ["#", "D", "T", "K"] and len(table) == 4
    # the command trains the model planned (its sequences fit the context, no dropout),
    # in a layout gpipe offers (the fastest here shards the optimizer state alone)
    assert table[1].split()[9] == "optimizer"
    assert "which gpipe does not offer" in out
    command = _train_command(out)
    assert " ".join(command).startswith(
        "train --n-layer 16 --d-model 2048 --n-head 16 --context 2048 --dropout 0 "
    )
    assert "--shard optimizer" not in " ".join(command)
    _trains(command, capsys)


def test_search_json_holds_what_the_table_says(capsys):
    """--search --json gave the least memory without its layout, and neither the model, the
    cluster nor the step and memory of the fastest layout gpipe trains, which the text
    prints beside the table."""
    args = ["--dropout", "0", "--global-batch", "256", "--search", "--top", "2"]
    assert main([*GPT, *args, "--seq-len", "8192", "--recompute", "none", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["model"] == "gpt 16x2048" and got["cluster"] == "64xA100-80GB"
    assert got["best"][0]["layout"]["shard"] == "optimizer"  # which gpipe does not offer
    trained = got["trained"]
    assert trained["layout"]["shard"] == "full" and trained["fits"]
    assert trained["step_time_s"] >= got["best"][0]["step_time_s"]
    assert "--shard full" in got["train_command"]
    assert got["rejected"]["does not fit in 80 GiB"] > 0
    least = got["least_memory_layout"]
    assert least["recompute"] == "none" and got["least_memory_gib"] > 80


def test_a_user_device_from_toml(tmp_path, capsys):
    path = tmp_path / "devices.toml"
    path.write_text(
        "[devices.MyGPU]\npeak_tflops = 500\nmemory_gib = 96\nmemory_tbps = 4\n"
        "gpus_per_node = 4\nintra_node_gbs = 400\ninter_node_gbits = 400\n"
        "gemm_efficiency = 0.6\n"
    )
    args = ["--cluster", "64xMyGPU", "--devices", str(path), "--global-batch", "64"]
    assert main([*GPT[:1], *GPT[3:], *args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "64xMyGPU"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--cluster", "64xV100", "--global-batch", "64"],
            "unknown device 'V100'; known devices: A100-40GB, A100-80GB, H100-SXM",
        ),
        (
            ["--tensor-parallel", "8", "--stages", "3", "--global-batch", "64"],
            "3 = 24 GPUs does not divide the cluster's 64",
        ),
        (
            [
                "--data-parallel",
                "4",
                "--tensor-parallel",
                "8",
                "--stages",
                "4",
                "--global-batch",
                "64",
            ],
            "4 = 128 GPUs, but the cluster has 64",
        ),
        (
            ["--tensor-parallel", "8", "--global-batch", "100"],
            "--global-batch 100 does not divide into D 8 replicas",
        ),
        (["--stages", "32", "--global-batch", "64"], "32 pipeline stages"),
        # a --data-parallel of 1 is read as given, not as the default
        (["--data-parallel", "1", "--global-batch", "64"], "= 1 GPUs, but the cluster has 64"),
        (["--n-layer", "0", "--global-batch", "64"], "--n-layer must be a positive integer"),
        (["--top", "3", "--global-batch", "64"], "--top lists the layouts of --search"),
        (
            ["--schedule", "zero-bubble-v", "--virtual-stages", "3", "--global-batch", "64"],
            "--virtual-stages 3: --schedule zero-bubble-v holds two stages per process",
        ),
        (["--precision", "fp32", "--global-batch", "64"], "invalid choice: 'fp32'"),
        (["--global-batch", "64", "--chunks", "8"], "--chunks is not read with --cluster"),
        (["--stages", "2"], "--cluster needs --global-batch"),
        (
            # 8 replicas cannot share 7 sequences, and one replica needs 8 stages or tensor
            # ranks that a model of 2 blocks and 2 heads does not have
            [
                "--cluster",
                "8xH100-SXM",
                "--n-layer",
                "2",
                "--n-head",
                "2",
                "--global-batch",
                "7",
                "--search",
            ],
            "no layout of the 8 GPUs runs this model with --global-batch 7: the global "
            "batch does not divide into D x micro-batch (16); more stages than layers",
        ),
    ],
)
def test_bad_input_is_one_line(capsys, args, message):
    cluster = [] if "--cluster" in args else ["--cluster", "64xA100-80GB"]
    argv = [*GPT[:1], *GPT[3:], *cluster, *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"max_position_embeddings": 0}, "max_seq_len must be a positive integer, got 0"),
        ({"text_config": 5}, "text_config must be a JSON object, got 5"),
        ({"num_hidden_layers": 32.0}, "layers must be a positive integer, got 32.0"),
        ({"num_key_value_heads": 0}, "kv_heads must be a positive integer, got 0"),
        ({"moe_layers": 5}, "moe_layers must be a list of block indices, got 5"),
        # a count of the wrong kind is named as given, not multiplied first
        ({"n_shared_experts": "2"}, "n_shared_experts must be a non-negative integer, got '2'"),
        # a width of 0 is refused, not read as the default
        ({"intermediate_size": 0}, "ffn must be a positive integer, got 0"),
        ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
        ({"attention_dropout": "x"}, "attention_dropout must be a probability, got 'x'"),
        ({"moe_layers": [0, 32]}, "moe_layers names blocks [32], but the model has 32 (0 to 31)"),
    ],
)
def test_a_malformed_config_is_one_line(tmp_path, capsys, fields, message):
    from ..planning.test_hf_config import MIXTRAL_8X7B

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MIXTRAL_8X7B, **fields}))
    args = ["plan", "--cluster", "8xH100-SXM", "--model", f"hf:{path}", "--global-batch", "64"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and len(err) < 300, err


def test_cluster_flags_need_cluster(capsys):
    assert main(["plan", "--global-batch", "64"]) == 2
    assert "--global-batch: needs --cluster NxDEVICE" in capsys.readouterr().err


def test_a_model_that_does_not_fit_says_what_it_needs(capsys):
    args = [
        "--cluster",
        "8xA100-40GB",
        "--n-layer",
        "96",
        "--d-model",
        "12288",
        "--n-head",
        "96",
        "--seq-len",
        "2048",
        "--global-batch",
        "8",
    ]
    assert main(["plan", *args]) == 1
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out
    assert captured.err.count("\n") == 1
    assert "gpipe: does not fit: D=8 T=1 K=1" in captured.err
    assert "GiB per GPU (weights" in captured.err and "the A100-40GB has 40 GiB" in captured.err
    # where the planner chose the micro-batch, the fastest is shown, and the least any needs
    args[args.index("--global-batch") + 1] = "64"
    assert main(["plan", *args]) == 1
    captured = capsys.readouterr()
    assert "micro-batch: 8, none fits; the fastest of 1, 2, 4, 8" in captured.out
    assert "b=8 M=1" in captured.err and "the least of the choices tried, " in captured.err
    assert "b=1 M=8 recompute=none shard=none, needs " in captured.err


def _moe_plan(capsys, tmp_path, config: dict, *args: str) -> dict:
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(config))
    layout = [
        "--tensor-parallel",
        "8",
        "--stages",
        "2",
        "--global-batch",
        "64",
        "--seq-len",
        "4096",
    ]
    assert main(["plan", "--cluster", "16xH100-SXM", "--model", f"hf:{path}", *layout, *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_mixture_of_experts_runs_its_routed_experts_and_holds_them_all(tmp_path, capsys):
    """Mixtral 8x7B: the MFU counts the FLOPs of the experts each token takes, the weights
    every expert; its step is slower than a dense model's as wide as the two experts a token
    takes (each expert multiplies a quarter of the tokens: smaller, slower products) and
    faster than one as wide as all eight."""
    from gpipe.planning.cluster_step import step_flops
    from gpipe.planning.hardware import parse_cluster
    from gpipe.planning.hf_config import from_hf_config

    from ..planning.test_hf_config import MIXTRAL_8X7B

    got = _moe_plan(capsys, tmp_path, MIXTRAL_8X7B, "--recompute", "full", "--json")
    assert got["model"]["experts"] == 8 and got["model"]["experts_per_token"] == 2
    assert got["model"]["active_parameters"] == pytest.approx(12.9e9, rel=0.01)
    (tmp_path / "mixtral.json").write_text(json.dumps(MIXTRAL_8X7B))
    shape = from_hf_config(tmp_path / "mixtral.json")
    _, model_flops = step_flops(shape, 64 * 4096, 4096, "full")
    peak = parse_cluster("16xH100-SXM").device.peak_flops
    assert got["mfu"] * got["step_time_s"] * 16 * peak == pytest.approx(model_flops, rel=1e-9)
    # stage 1 of 2 on one GPU of 8: 16 blocks with every expert, and the output matrix
    held = (16 * shape.layer_params(moe=True) + shape.embedding_params()) / 8
    assert got["memory_gib"]["weights"] == pytest.approx(2 * held / 2**30, rel=1e-9)

    dense = {k: v for k, v in MIXTRAL_8X7B.items() if "expert" not in k}
    as_wide = {**dense, "intermediate_size": 2 * 14336}
    all_eight = {**dense, "intermediate_size": 8 * 14336}
    times = [
        _moe_plan(capsys, tmp_path, c, "--recompute", "full", "--json")["step_time_s"]
        for c in (as_wide, all_eight)
    ]
    assert times[0] < got["step_time_s"] < times[1]


def test_search_over_a_mixture_of_experts_gives_a_command_gpipe_train_runs(tmp_path, capsys):
    """Splitting the experts over T GPUs is what makes Mixtral fastest on 32 H100s, and
    gpipe train splits them: the command it prints takes them so."""
    from ..planning.test_hf_config import MIXTRAL_8X7B

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_8X7B))
    args = ["plan", "--cluster", "32xH100-SXM", "--model", f"hf:{path}", "--global-batch", "64"]
    assert main([*args, "--seq-len", "4096", "--tensor-parallel", "8", "--stages", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mixtral: 46.7 B parameters, 12.9 B active (32 blocks of 4096, 32 ")
    assert main([*args, "--seq-len", "4096", "--search", "--top", "2"]) == 0
    command = _train_command(capsys.readouterr().out)
    assert command[command.index("--tensor-parallel") + 1] != "1"
    _trains(command, capsys)


def test_deepseek_v3_with_latent_attention_and_dense_first_blocks_is_planned(tmp_path, capsys):
    from ..planning.test_hf_config import DEEPSEEK_V3

    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    args = ["plan", "--cluster", "2048xH100-SXM", "--model", f"hf:{path}", "--seq-len", "4096"]
    layout = ["--global-batch", "1920", "--tensor-parallel", "8", "--stages", "16"]
    assert main([*args, *layout, "--recompute", "full", "--shard", "optimizer"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("deepseek_v3: 671.0 B parameters, 37.6 B active (61 blocks of 7168, 58")
    assert "(fits)" in out


def test_a_search_under_flash_attention_tries_no_selective_recomputation(capsys):
    """Under FlashAttention selective recomputation keeps and redoes what none does: the
    search tries it once, as none, rather than listing every layout twice."""
    argv = [*GPT[:2], "64xH100-SXM", *GPT[3:], "--global-batch", "256", "--search", "--json"]
    assert main([*argv, "--top", "8"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert {p["layout"]["recompute"] for p in found["best"]} <= {"none", "full"}
    assert main([*argv, "--recompute", "selective"]) == 0  # pinned, it is searched
    assert {p["layout"]["recompute"] for p in json.loads(capsys.readouterr().out)["best"]} == {
        "selective"
    }


@pytest.mark.parametrize(
    ("config", "seq_len"),
    [
        ({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12}, "4096"),
        ({"model_type": "llama", "max_position_embeddings": 1024}, "1025"),
    ],
    ids=["gpt2 n_positions", "llama max_position_embeddings"],
)
def test_a_sequence_longer_than_the_models_context_is_planned_with_a_note(
    tmp_path, capsys, config, seq_len
):
    """gpipe train refuses --seq-len above the config's longest sequence; the plan of such a
    step (a longer context, planned before extending it) is printed with a note that says so."""
    base = {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "vocab_size": 1000,
        "n_positions": 1024,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **config}))
    args = ["plan", "--cluster", "8xH100-SXM", "--model", f"hf:{path}", "--global-batch", "64"]
    assert main([*args, "--seq-len", seq_len]) == 0
    err = capsys.readouterr().err
    assert f"note: --seq-len {seq_len} is above the model's longest sequence of 1024" in err, err
    assert err.count("\n") == 1
    assert main([*args, "--seq-len", "1024", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["seq_len"] == 1024
    # the GPT's shape flags are refused with a config, tying among them
    assert main([*args, "--no-tie-embeddings"]) == 2
    err = capsys.readouterr().err
    assert "--no-tie-embeddings is the GPT's; --model hf:" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "pinned",
    [
        {"--virtual-stages": "2"},
        {"--virtual-stages": "3", "--stages": "4"},
        {"--schedule": "interleaved", "--virtual-stages": "1"},
        {"--shard": "full"},
        {"--shard": "gradients", "--stages": "4"},
    ],
    ids=["v 2", "v 3 on 4 stages", "interleaved v 1", "shard full", "shard gradients"],
)
def test_search_lists_only_layouts_with_the_flags_given(capsys, pinned):
    """Each flag given is pinned: every layout listed has it, as the plan of that one layout
    would (--virtual-stages 2 is not a schedule of one stage per process, --shard is not a
    layout of one replica)."""
    flags = [x for item in pinned.items() for x in item]
    argv = [*GPT[:2], "16xH100-SXM", *GPT[3:], "--global-batch", "256", *flags]
    assert main([*argv, "--search", "--top", "20", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["best"]
    for p in found["best"]:
        layout = p["layout"]
        for flag, value in pinned.items():
            got = layout[flag[2:].replace("-", "_")]
            assert str(got) == value, (flag, layout)
        # the same layout, planned alone, runs
        keys = ("tensor_parallel", "stages", "schedule", "virtual_stages", "micro_batch")
        keys += ("recompute", "shard")
        one = [x for key in keys for x in (f"--{key.replace('_', '-')}", str(layout[key]))]
        assert main([*argv[: argv.index("--global-batch")], "--global-batch", "256", *one]) == 0
        capsys.readouterr()


def test_a_cluster_of_one_node_says_node(capsys):
    argv = [*GPT[:2], "8xH100-SXM", *GPT[3:], "--global-batch", "64"]
    assert main(argv) == 0
    assert "cluster 8xH100-SXM: 1 node of 8, " in capsys.readouterr().out


@pytest.mark.parametrize(
    ("keys", "cheaper"),
    [
        ({"sliding_window": 4096}, True),
        ({"sliding_window": None}, False),
        ({"sliding_window": 32768}, False),  # as long as the sequence: full attention
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, False),
    ],
    ids=["window", "null", "window-of-s", "qwen2-off"],
)
def test_a_sliding_window_is_priced_as_its_band(tmp_path, capsys, keys, cheaper):
    """Mistral 7B at 32,768 tokens: over a window of 4,096 the step is faster and its
    model FLOPs (MFU x step time) 0.581 of full attention's; a window disabled or as long as
    the sequence prices exactly as none."""
    config = {"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096}
    config |= {"intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}
    config |= {"vocab_size": 32000, "hidden_act": "silu", "max_position_embeddings": 32768}

    def plan(extra: dict) -> dict:
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**config, **extra}))
        args = ["plan", "--cluster", "8xH100-SXM", "--model", f"hf:{path}", "--global-batch", "8"]
        args += ["--tensor-parallel", "8", "--recompute", "full", "--json"]
        assert main(args) == 0
        return json.loads(capsys.readouterr().out)

    full = plan({"sliding_window": None, "model_type": keys.get("model_type", "mistral")})
    got = plan(keys)
    if not cheaper:
        assert got == full
        return
    assert got["step_time_s"] < 0.75 * full["step_time_s"]
    flops = got["mfu"] * got["step_time_s"] / (full["mfu"] * full["step_time_s"])
    assert flops == pytest.approx(0.5811, abs=1e-4)
