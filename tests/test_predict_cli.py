"""``gogh predictors train|evaluate`` end to end, with tiny epochs on a three-type synthetic fleet."""

from __future__ import annotations

import json

from gogh_flows.cli import main
from gogh_flows.predict.io import load_p1, load_p2, read_card
from gogh_flows.predict.evaluate import METHODS, METRICS

TINY = ["--truth", "synthetic", "--gpu-types", "k80,v100,a100", "--p1-epochs", "3", "--p2-epochs", "3"]


def test_train_writes_two_model_directories_with_cards(tmp_path, capsys):
    out = tmp_path / "prior"
    assert main(["predictors", "train", *TINY, "--out", str(out), "--exclude-family", "CycleGAN"]) == 0
    p1, p2 = load_p1(out / "p1"), load_p2(out / "p2")
    assert "CycleGAN" not in p2.layout.partners and set(p2.layout.gpus) == {"k80", "v100", "a100"}
    assert p1.trained_on["excluded_families"] == ["CycleGAN"]
    # calibrated on the inner split of the training families: what a risk level plans with
    assert set(p2.trained_on["intervals"]["halfwidths"]) == {"isolated", "isolated_1obs", "colocated",
                                                             "colocated_1obs"}
    # and the ensemble the product predicts with, chosen on the same split (read back as it is used)
    from gogh_flows.predict.service import ThroughputPredictor

    ensemble = ThroughputPredictor(p1, p2).ensemble
    assert ensemble is not None and set(ensemble.weights) == set(p2.trained_on["intervals"]["halfwidths"])
    assert "CycleGAN" not in ensemble.rows.slowdown and "of the ensemble" in p2.trained_on["intervals"]["calibration"]
    for d in ("p1", "p2"):
        card = read_card(out / d)
        assert "**CycleGAN**" in card and "gogh predictors train" in card and "MAPE" in card
    assert f"isolated_1obs {ensemble.weights['isolated_1obs']:g}" in read_card(out / "p2")  # the card says
    assert f"with the {ensemble.baseline('colocated_1obs').replace('_', '-')} row" in read_card(out / "p2")
    assert json.loads(capsys.readouterr().out)["out"] == str(out)


def test_train_with_the_mean_of_the_encoders(tmp_path, capsys):
    """`--encoder mean` ships one P1 holding a P1 per encoder; the refiner learns from that mean
    P1's out-of-family errors, and `calibrate` (no options) calibrates with the same kind of P1."""
    from gogh_flows.predict.p1 import ENCODERS, P1MeanNet

    out = tmp_path / "prior"
    args = ["--truth", "synthetic", "--gpu-types", "k80,v100", "--p1-epochs", "2", "--p2-epochs", "2",
            "--exclude-family", "CycleGAN", "--exclude-family", "A3C", "--exclude-family", "Recommendation"]
    assert main(["predictors", "train", *args, "--encoder", "mean", "--out", str(out)]) == 0
    p1 = load_p1(out / "p1")
    assert isinstance(p1.net, P1MeanNet) and p1.config.encoder == "mean"
    assert set(p1.trained_on["members"]) == set(ENCODERS)
    assert "--encoder mean" in read_card(out / "p1")
    capsys.readouterr()
    assert main(["predictors", "calibrate", "--model", str(out)]) == 0
    assert load_p2(out / "p2").trained_on["ensemble"]["weights"]
    # 'inner': the mean or one encoder, as the evaluation chooses, recorded with its evidence
    chosen = tmp_path / "chosen"
    assert main(["predictors", "train", *args, "--encoder", "inner", "--out", str(chosen)]) == 0
    p1 = load_p1(chosen / "p1")
    errs = p1.trained_on["encoder_choice"]["inner_male"]
    assert set(errs) == {"gru", "ff", "transformer", "mean", "one chosen (nested)"}
    assert p1.config.encoder == p1.trained_on["encoder_choice"]["chosen"]
    assert (p1.config.encoder == "mean") == (errs["mean"] < errs["one chosen (nested)"])
    assert "chosen on the inner split" in read_card(chosen / "p1") and "--encoder inner" in read_card(chosen / "p1")
    assert load_p2(chosen / "p2").trained_on["p1_encoder"] == p1.config.encoder  # what the refiner corrects
    # one family left: refused before anything is trained, saying what to do
    capsys.readouterr()
    lone = ["--exclude-family", "LM", "--exclude-family", "ResNet-18", "--exclude-family", "Transformer"]
    assert main(["predictors", "train", *args, *lone, "--encoder", "inner", "--out", str(tmp_path / "lone")]) == 2
    err = capsys.readouterr().err
    assert "leaves 1 model family" in err and "exclude fewer" in err and not (tmp_path / "lone").exists()
    capsys.readouterr()
    assert main(["predictors", "train", *args, "--encoder", "lstm", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "lstm" in err and "inner" in err and not (tmp_path / "bad").exists()  # refused before training


def test_calibrate_adds_intervals_to_a_refiner_trained_without_them(tmp_path, capsys):
    out = tmp_path / "prior"
    assert main(["predictors", "train", *TINY, "--out", str(out), "--exclude-family", "CycleGAN"]) == 0
    p2 = load_p2(out / "p2")
    trained = dict(p2.trained_on)
    del p2.trained_on["intervals"], p2.trained_on["ensemble"]
    from gogh_flows.predict.io import save_model

    save_model(p2, out / "p2", read_card(out / "p2"))
    assert not {"intervals", "ensemble"} & set(load_p2(out / "p2").trained_on)
    capsys.readouterr()
    assert main(["predictors", "calibrate", *TINY, "--model", str(out), "--exclude-family", "CycleGAN"]) == 0
    again = load_p2(out / "p2")
    assert again.trained_on["intervals"]["levels"] == [0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
    # the same split, the same seed: what train chose
    assert again.trained_on["ensemble"] == trained["ensemble"]
    assert read_card(out / "p2")  # the card is kept
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"] == str(out / "p2") and printed["ensemble_weights"] == trained["ensemble"]["weights"]
    # with no options at all: the model's own data, families, P1 and P2 settings (3 epochs here,
    # not the command's defaults), so the same choice again
    assert main(["predictors", "calibrate", "--model", str(out)]) == 0
    assert load_p2(out / "p2").trained_on["ensemble"] == trained["ensemble"]


def test_evaluate_writes_every_method_and_metric(tmp_path, capsys):
    target = tmp_path / "eval.json"
    assert main(["predictors", "evaluate", *TINY, "--holdout-family", "A3C", "--repeats", "1",
                 "--json", str(target)]) == 0
    def strict(token):
        raise AssertionError(f"{token} in the JSON report: not strict JSON")

    report = json.loads(target.read_text(), parse_constant=strict)
    assert list(report["families"]) == ["A3C"]
    # A3C is one job type: no siblings, so that metric is null, not NaN
    assert report["families"]["A3C"]["p2"]["isolated_mape_1obs_siblings"] is None
    for m in METHODS:
        assert set(report["mean"][m]) == set(METRICS)
        assert report["families"]["A3C"][m] == report["mean"][m]
    # the new figures beside the kept ones: per job type, per revealed type, the data check's verdict
    assert set(report["mean_over_jobs"]) == set(METHODS) and report["jobs"]
    assert {"p1_shifted", "type_mean", "partner_mean", "roofline"} <= set(report["methods"])
    assert set(report["isolated_male_1obs_by_revealed_type"]["p2"]) == {"k80", "v100", "a100"}
    assert report["anomalies"]["excluded"] is False and isinstance(report["anomalies"]["entries"], list)
    # P1's encoder, chosen per held-out family on the training families (the default 'inner')
    # (the mean of the three against the one the inner split picks, that pick scored nested)
    chosen = report["p1_encoder"]["A3C"]
    errs = chosen["inner_male"]
    assert set(errs) == {"gru", "ff", "transformer", "mean", "one chosen (nested)"}
    singles = {e: errs[e] for e in ("gru", "ff", "transformer")}
    if errs["mean"] < errs["one chosen (nested)"]:
        assert chosen["chosen"] == "mean"
    else:
        assert chosen["chosen"] == min(singles, key=singles.get)
    assert errs["one chosen (nested)"] >= min(singles.values())  # nested: never flattered by the pick
    assert report["config"]["encoders"] == ["gru", "ff", "transformer", "mean"]
    assert set(report["ensemble_baseline"]["A3C"]) == {"isolated", "colocated", "isolated_1obs", "colocated_1obs"}
    assert report["config"]["p2_epochs"] == [3] and report["p2_epochs"]["A3C"]["inner_male"] == {}  # fixed by --p2-epochs
    printed = capsys.readouterr().out
    assert "MEAN" in printed and "matrix_completion" in printed and "isolated_male_1obs" in printed


def test_evaluate_refuses_an_unknown_encoder_before_any_training(capsys):
    assert main(["predictors", "evaluate", *TINY, "--encoder", "gru,lstm"]) == 2
    err = capsys.readouterr().err
    assert "lstm" in err and "inner" in err


def test_evaluate_names_the_families_when_one_is_unknown(capsys):
    assert main(["predictors", "evaluate", *TINY, "--holdout-family", "VGG"]) == 2
    err = capsys.readouterr().err
    assert "VGG" in err and "ResNet-50" in err


def test_a_truth_given_as_a_relative_path_is_recorded_so_calibrate_reads_it_from_anywhere(gavel_dir, tmp_path,
                                                                                          monkeypatch, capsys):
    """The path was recorded as typed: `gogh predictors calibrate --model DIR` from another folder
    refused it ("cannot be read from here"), and a retraining there learned from its runs alone."""
    import shutil

    shutil.copy(gavel_dir / "physical_cluster_throughputs.json", tmp_path / "ours.json")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "prior"
    args = ["--truth", "ours.json", "--gpu-types", "k80,v100", "--p1-epochs", "2", "--p2-epochs", "2",
            "--exclude-family", "A3C", "--exclude-family", "Recommendation", "--exclude-family", "CycleGAN"]
    assert main(["predictors", "train", *args, "--out", str(out)]) == 0
    for kind in ("p1", "p2"):
        assert (load_p1 if kind == "p1" else load_p2)(out / kind).trained_on["truth"] == str(tmp_path / "ours.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["predictors", "calibrate", "--model", str(out)]) == 0, capsys.readouterr().err
    assert load_p2(out / "p2").trained_on["intervals"]
