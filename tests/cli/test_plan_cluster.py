"""`gpipe plan --cluster`: one layout's prediction as lines or JSON, --search's table and
command, and bad input in one line each."""

import json

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


def test_search_prints_the_fastest_why_the_others_do_not_and_a_command(capsys):
    assert main([*GPT, "--global-batch", "256", "--search", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts searched" in out and "why the others were left:" in out
    assert "fit, but slower" in out and "run the fastest: gpipe train --n-layer 16" in out
    table = out.split("\n")[1:5]
    assert table[0].split()[:4] == ["#", "D", "T", "K"] and len(table) == 4


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
        (["--global-batch", "64", "--chunks", "8"], "--chunks is not read with --cluster"),
        (["--stages", "2"], "--cluster needs --global-batch"),
    ],
)
def test_bad_input_is_one_line(capsys, args, message):
    cluster = [] if "--cluster" in args else ["--cluster", "64xA100-80GB"]
    argv = [*GPT[:1], *GPT[3:], *cluster, *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_cluster_flags_need_cluster(capsys):
    assert main(["plan", "--tensor-parallel", "2"]) == 2
    assert "--tensor-parallel: needs --cluster NxDEVICE" in capsys.readouterr().err


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
