"""The scheduled refiner-retraining deployment: register a challenger, promote only if better."""

from __future__ import annotations

import re
import shutil

import math
import random
import time

import pytest

from gogh_flows.flows.blocks import PredictorRegistry, state_dir
from gogh_flows.flows.predictors import predictor_source
from gogh_flows.flows.retrain import refine_predictors, split_recent
from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.io import save_model
from gogh_flows.predict.p2 import P2Config
from gogh_flows.predict.service import fit_refiner
from gogh_flows.tracking.measurements import Measurement, MeasurementLog
from gogh_flows.truth.synthetic import synthetic_table

pytestmark = pytest.mark.usefixtures("prefect_server")

GPUS = ["k80", "v100", "t4", "a100"]
# The fleet really runs slower than the synthetic prior thinks, and more so on older
# generations (an input pipeline that a faster GPU hides): a cross-type pattern a refiner
# can learn from measurements, and no uniform shift captures.
SLOWDOWN = {"k80": 0.45, "v100": 0.7, "t4": 0.6, "a100": 0.85}


def _log_measurements(n_jobs: int = 14, seed: int = 0, root=None, ago_s: float = 10_000, prefix: str = "r",
                      uri: str | None = None) -> int:
    table = synthetic_table(GPUS)
    log = MeasurementLog(uri or PredictorRegistry().resolved_tracking_uri(), root or state_dir() / "measurements")
    rng = random.Random(seed)
    fits = [j for j in table.job_types if all(table.has(j, g, 1) and table.isolated(j, g) > 0 for g in GPUS)]
    jobs = rng.sample(fits, n_jobs)
    t = time.time() - ago_s
    count = 0
    # three GPU types of every job first, the fourth (a different one per job) last: the
    # most recent rows, which retraining holds out, are unseen entries of observed jobs
    order = [(j, g, k < 3) for i, j in enumerate(jobs) for k, g in enumerate(GPUS[i % 4:] + GPUS[:i % 4])]
    order.sort(key=lambda x: not x[2])
    for j, g, _ in order:
        tput = table.isolated(j, g) * SLOWDOWN[g] * math.exp(rng.gauss(0, 0.02))
        t += 1
        log.log(Measurement(
            run_id=f"{prefix}{count}", flow_name="t", job_type=j, family=None, batch_size=None,
            gpu_id=f"{g}-0", gpu_type=g, device=f"{g}-0", partners=(), required_throughput=tput / 2,
            predicted_throughput=None, steps=100.0, duration_s=100.0 / tput, throughput=tput,
            mean_power_w=100.0, energy_j=1000.0, status="completed", telemetry="emulated", started_at=t))
        count += 1
    return count


def _weak_champion(tmp_path) -> int:
    """Make the champion a P2 trained for another fleet (P100s and H100s): here it cannot use
    what was observed on this fleet's GPU types, so it is as good as P1 alone."""
    source = predictor_source(PredictorRegistry())
    champion = source.get(force=True)
    other = ["p100", "h100"]
    weak = fit_refiner(champion.p1, {}, _empty_obs(), base=MeasuredSet.from_table(synthetic_table(other)),
                       config=P2Config(epochs=20, seed=1), gpu_types=other)
    save_model(weak, tmp_path / "weak")
    version = source.registry.register("gogh-p2", tmp_path / "weak", alias="champion")
    source.get(force=True)
    return version


def _empty_obs():
    import polars as pl

    return pl.DataFrame(schema={"job_type": pl.String, "gpu_type": pl.String, "partner": pl.String,
                                "throughput": pl.Float64})


def test_split_recent_holds_out_the_newest_rows():
    import polars as pl

    frame = pl.DataFrame({"x": list(range(10))})
    train, test = split_recent(frame, 0.25)
    assert train["x"].to_list() == list(range(7)) and test["x"].to_list() == [7, 8, 9]


def test_split_recent_never_tests_runs_a_judged_model_learned():
    import polars as pl

    from gogh_flows.flows.retrain import run_digests

    frame = pl.DataFrame({"key": [f"run{i}:gpu" for i in range(10)]})
    seen = run_digests(frame.filter(pl.col("key").is_in(["run8:gpu", "run9:gpu", "run2:gpu"])))
    train, test = split_recent(frame, 0.25, seen)
    # the three newest it never learned, in their order; what it learned trains, however new
    assert test["key"].to_list() == ["run5:gpu", "run6:gpu", "run7:gpu"]
    assert train["key"].to_list() == [f"run{i}:gpu" for i in (0, 1, 2, 3, 4, 8, 9)]
    # fewer unseen runs than the holdout share: all of them; none: nothing to test
    train, test = split_recent(frame, 0.5, run_digests(frame.tail(8)))
    assert test["key"].to_list() == ["run0:gpu", "run1:gpu"] and train.height == 8
    assert split_recent(frame, 0.25, run_digests(frame))[1].is_empty()


def test_a_champion_trained_elsewhere_is_never_scored_on_the_runs_it_learned(gogh_home, tmp_path):
    """A team's machines share the tracking store and the registry. Machine B retrained on its
    runs, and its challenger became the champion. Machine A, whose own runs all started before
    B's, pulls B's runs and retrains: the newest quarter of its table then held runs the champion
    was trained on, so the champion was scored on its own training data and favoured (5 of 19
    held-out runs here). The champion's training runs travel with it and are never held out."""
    _weak_champion(tmp_path)
    b_root = tmp_path / "machine-b" / "measurements"
    n_b = _log_measurements(root=b_root, prefix="b")
    on_b = refine_predictors(base_data="none", epochs=120, measurements_dir=str(b_root))
    assert on_b["promoted"] is True and on_b["train_measurements"] == 42
    champion = predictor_source(PredictorRegistry()).get(force=True).p2
    assert len(champion.trained_on["training_runs"]) == 42
    # machine A: its own 20 runs, all older than B's, then the retraining takes in B's
    n_a = _log_measurements(n_jobs=5, seed=1, ago_s=30_000, prefix="a")
    on_a = refine_predictors(base_data="none", epochs=120)
    assert on_a["train_measurements"] + on_a["holdout_measurements"] == n_a + n_b
    # the table as A's retraining read it: by age alone, 5 of the 19 held out were the champion's
    from gogh_flows.flows.observations import observations_from_measurements
    from gogh_flows.flows.retrain import run_digests, trained_runs

    obs = observations_from_measurements(MeasurementLog(PredictorRegistry().resolved_tracking_uri(),
                                                        state_dir() / "measurements").read(), keys=True)
    seen = trained_runs(champion)
    assert len(run_digests(split_recent(obs, 0.25)[1]) & seen) == 5
    assert not run_digests(split_recent(obs, 0.25, seen)[1]) & seen
    # held out: B's 14 held-out runs and A's 5 newest, none of the champion's 42 training runs
    assert on_a["holdout_measurements"] == 19 and on_a["champion_trained_measurements"] == 42
    # the challenger carries its own training runs (the champion's, when it kept their weights)
    registry = predictor_source(PredictorRegistry()).registry
    from gogh_flows.predict.io import load_p2

    path, _ = registry.download(f"models:/gogh-p2/{on_a['challenger_version']}", dest=tmp_path / "challenger")
    challenger = load_p2(path)
    assert len(challenger.trained_on["training_runs"]) >= on_a["train_measurements"]


def test_a_retraining_with_every_run_learned_by_the_champion_judges_nothing(gogh_home, tmp_path):
    _weak_champion(tmp_path)
    _log_measurements()
    source = predictor_source(PredictorRegistry())
    versions = source.registry.versions("gogh-p2").height
    # a champion trained on every run this table holds (as another machine's retraining could be)
    import polars as pl

    from gogh_flows.flows.observations import observations_from_measurements
    from gogh_flows.flows.retrain import run_digests

    champion = source.get(force=True)
    keys = observations_from_measurements(MeasurementLog(PredictorRegistry().resolved_tracking_uri(),
                                                         state_dir() / "measurements").read(), keys=True)
    assert keys.height == 56 and keys["key"].null_count() == 0 and isinstance(keys, pl.DataFrame)
    champion.p2.trained_on["training_runs"] = sorted(run_digests(keys))
    save_model(champion.p2, tmp_path / "knows-all")
    source.registry.register("gogh-p2", tmp_path / "knows-all", alias="champion")
    out = refine_predictors(base_data="none", epochs=120)
    assert out["promoted"] is False and out["reason"].startswith("all 56 usable measurements trained the champion")
    assert source.registry.versions("gogh-p2").height == versions + 1  # the champion registered above, no challenger


def test_a_retraining_sends_the_measurements_spooled_through_an_outage_to_the_tracking_store(gogh_home, tmp_path):
    """Measurements spooled while MLflow was down went out only with a later placed run's mirror:
    a machine that placed nothing more kept them from the team's store, and from every other
    machine's retraining, for good (a new-user review). The retraining sends them first."""
    import socket

    with socket.socket() as sock:  # a port nobody listens on: MLflow down
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}"
    n = _log_measurements(n_jobs=2, uri=down)
    root = state_dir() / "measurements"
    assert len(MeasurementLog(down, root).spooled()) == n
    out = refine_predictors(base_data="none", epochs=120, min_measurements=100)  # too few: the spool goes out anyway
    assert out["promoted"] is False and "nothing retrained" in out["reason"]
    assert MeasurementLog(PredictorRegistry().resolved_tracking_uri(), root).spooled() == []
    elsewhere = MeasurementLog(PredictorRegistry().resolved_tracking_uri(), tmp_path / "another-machine")
    assert elsewhere.pull() == n and elsewhere.read().height == n


def test_scheduled_deployment_promotes_a_better_challenger(gogh_home, tmp_path):
    from prefect.deployments import run_deployment
    from prefect.flow_engine import run_flow

    weak = _weak_champion(tmp_path)
    _log_measurements()
    deployment_id = refine_predictors.to_deployment("refine-test", cron="0 * * * *",
                                                    parameters={"base_data": "none", "epochs": 200}).apply()
    assert deployment_id
    flow_run = run_deployment("gogh-refine-predictors/refine-test", timeout=0)
    result = run_flow(refine_predictors, flow_run=flow_run,
                      parameters={"base_data": "none", "epochs": 200, "min_measurements": 8})
    assert result["challenger_mape"] < result["champion_mape"]
    assert result["promoted"] is True and result["previous_champion_version"] == weak
    # what it read, as every outcome says (a promoted one lacked the key, a review)
    assert result["measurements"] >= result["train_measurements"] + result["holdout_measurements"] > 0
    # a challenger descends from its P1's prior, and says so (no other prior's P1 goes beside it)
    from gogh_flows.flows.predictors import PRIOR_ID_TAG

    lineage = predictor_source(PredictorRegistry()).registry.version_tags
    assert lineage("gogh-p2", result["challenger_version"])[PRIOR_ID_TAG] == lineage("gogh-p1", 1)[PRIOR_ID_TAG]
    registry = predictor_source(PredictorRegistry()).registry
    assert registry.version_for("gogh-p2", "champion") == result["challenger_version"]
    assert registry.version_for("gogh-p2", "challenger") == result["challenger_version"]
    # how far the champion trusts its corrections over P1 was chosen in the flow and travels with it
    from gogh_flows.predict.p2 import TRUST_SCALES

    assert result["trust_scale"] in TRUST_SCALES and result["p1_mape"] > 0
    champion = predictor_source(PredictorRegistry()).get(force=True)
    assert champion.p2.trust_scale == result["trust_scale"]
    # this fleet runs slower than the prior's world on every type: the per-type offsets that carry
    # that to jobs with nothing measured travel with the champion too
    site = champion.p2.trained_on["site_offsets"]
    assert set(site["unmeasured"]) == set(GPUS) and all(v < 0 for v in site["unmeasured"].values())
    assert champion.site.unmeasured == site["unmeasured"]
    # a refiner trained on this fleet's runs alone has learned its cross-type pattern: the
    # validation runs keep the offsets off measured jobs, which it would count twice
    assert site["anchored"] is False and set(champion.p2.trained_on["site_anchoring_validation_mape"]) == {
        "anchored", "measured jobs left to the refiner"}


def test_an_equal_challenger_is_registered_but_not_promoted(gogh_home, tmp_path):
    _weak_champion(tmp_path)
    _log_measurements()
    first = refine_predictors(base_data="none", epochs=120)
    assert first["promoted"] is True and first["reason"] == "promoted to champion"
    registry = predictor_source(PredictorRegistry()).registry
    before = registry.versions("gogh-p2").height
    # the same measurements and settings against the challenger just promoted: it would be trained
    # again into the same model (a new-user review found a version byte for byte the champion's),
    # so nothing is registered
    second = refine_predictors(base_data="none", epochs=120)
    assert second["promoted"] is False and second["reason"] == (
        f"nothing new since challenger v{first['challenger_version']}, promoted to champion: the same "
        f"{second['measurements']} measurements and settings; nothing retrained")
    assert registry.versions("gogh-p2").height == before
    # other settings are something new: trained on the same runs as the champion, the challenger is
    # about as good (up to the last digits, which once decided a promotion), so not promoted
    third = refine_predictors(base_data="none", epochs=120, min_improvement=0.5)
    assert third["challenger_version"] == first["challenger_version"] + 1
    assert third["champion_mape"] == pytest.approx(first["challenger_mape"])
    assert third["promoted"] is False and re.fullmatch(
        r"not promoted: (no better than the champion|\d+\.\d% better than the champion, less than the 50% required) "
        r"\(holdout MAPE \d+\.\d\d% against \d+\.\d\d%\)", third["reason"]), third["reason"]
    assert registry.version_for("gogh-p2", "champion") == first["challenger_version"]
    assert registry.version_for("gogh-p2", "challenger") == third["challenger_version"]
    # nothing new since (the same measurements, settings and champion): no identical version
    fourth = refine_predictors(base_data="none", epochs=120, min_improvement=0.5)
    assert fourth["promoted"] is False and fourth["reason"].startswith(
        f"nothing new since challenger v{third['challenger_version']}: the same")
    assert registry.versions("gogh-p2").height == before + 1


def test_retrainings_started_together_take_turns_and_the_second_faces_the_first_ones_champion(
        gogh_home, tmp_path):
    """Two retrainings at once (a scheduled run outlasting its interval, a manual one beside it):
    without a lock both read the weak champion, both beat it and both promote, the second undoing
    the first unseen. With Prefect's global concurrency limit they take turns."""
    from concurrent.futures import ThreadPoolExecutor

    from prefect.client.orchestration import get_client

    weak = _weak_champion(tmp_path)
    _log_measurements()
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: refine_predictors(base_data="none", epochs=120), range(2)))
    first, second = sorted(outs, key=lambda o: not o["promoted"])  # the second registers nothing
    assert first["promoted"] is True and first["previous_champion_version"] == weak
    # the second began after the first had promoted, against its champion: the same data and settings
    # would train the same model again, so it registers nothing and says against which version
    assert second["champion_version"] == first["challenger_version"] == second["challenger_version"]
    assert second["promoted"] is False and second["reason"].startswith(
        f"nothing new since challenger v{first['challenger_version']}, promoted to champion")
    registry = predictor_source(PredictorRegistry()).registry
    assert registry.version_for("gogh-p2", "champion") == first["challenger_version"]
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name("gogh-refine-gogh-p2")
    assert limit.limit == 1 and limit.active_slots == 0  # released by both


def test_a_retraining_slot_left_taken_is_said_with_how_to_free_it_and_a_changed_limit_is_put_back(gogh_home):
    """A holder killed without cleaning up leaves the slot taken (the temporary server frees no
    lapsed lease): the next retraining waits lock_wait_s, then says what to run; a limit someone
    widened is put back to one slot, or two retrainings would overlap."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate

    from gogh_flows.flows.retrain import RetrainingBusy

    from prefect.exceptions import ObjectAlreadyExists

    name = "gogh-refine-gogh-p2"
    with get_client(sync_client=True) as client:  # the server outlives a test: the limit may exist
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1, active_slots=1))
        except ObjectAlreadyExists:
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=1, active_slots=1))
    with pytest.raises(RetrainingBusy, match=f"prefect gcl update {name} --active-slots 0"):
        refine_predictors(min_measurements=8, lock_wait_s=2)
    with get_client(sync_client=True) as client:
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=3, active_slots=0))
    out = refine_predictors(min_measurements=8, lock_wait_s=30)
    assert "nothing retrained" in out["reason"]
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(name)
    assert limit.limit == 1 and limit.active and limit.active_slots == 0
    with pytest.raises(ValueError, match="lock_wait_s must be"):
        refine_predictors(lock_wait_s=0)


def test_a_timeout_inside_a_retraining_is_not_taken_for_the_lock(gogh_home, monkeypatch):
    """Only the wait for the slot is the lock's: a TimeoutError the retraining itself raises (an
    MLflow call, say) goes on as it is, the slot freed, not reported as another retraining's."""
    from prefect.client.orchestration import get_client

    from gogh_flows.flows import retrain

    def stalls(*_a, **_k):
        raise TimeoutError("the tracking server did not answer")

    monkeypatch.setattr(retrain, "observations_from_measurements", stalls)
    with pytest.raises(TimeoutError, match="the tracking server did not answer") as raised:
        refine_predictors(min_measurements=8, lock_wait_s=30)
    assert not isinstance(raised.value, retrain.RetrainingBusy)
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name("gogh-refine-gogh-p2").active_slots == 0


def test_a_retraining_learns_from_what_other_machines_logged_to_the_shared_store(gogh_home, tmp_path, caplog):
    """A team's machines each keep their own table and log to one MLflow store; the retraining,
    wherever it runs, read only its own table ("only 0 usable measurements", Completed). It takes
    the store's runs into its table first; a user model whose layer features only its own machine
    has is left out with a warning, not a KeyError that failed the whole retraining."""
    _weak_champion(tmp_path)
    elsewhere = tmp_path / "other-machine" / "measurements"
    n = _log_measurements(root=elsewhere)
    MeasurementLog(PredictorRegistry().resolved_tracking_uri(), elsewhere).log(Measurement(
        run_id="user-model-run", flow_name="t", job_type="HostModel (batch size 16)", family=None, batch_size=16,
        gpu_id="v100-0", gpu_type="v100", device="v100-0", partners=(), required_throughput=1.0,
        predicted_throughput=None, steps=100.0, duration_s=10.0, throughput=10.0, mean_power_w=100.0,
        energy_j=1000.0, status="completed", telemetry="emulated", started_at=time.time() - 20_000))
    with caplog.at_level("WARNING"):
        out = refine_predictors(base_data="none", epochs=120)
    assert out["train_measurements"] + out["holdout_measurements"] == n and out["promoted"] is True
    assert "HostModel (batch size 16)" in caplog.text and "left out of this retraining" in caplog.text
    with pytest.raises(ValueError, match="measurements_dir .*measurments.* is not a folder"):
        refine_predictors(measurements_dir=str(tmp_path / "measurments"))
    assert not (tmp_path / "measurments").exists()  # a typo no longer makes an empty folder and reports 0


def test_too_few_measurements_retrain_nothing(gogh_home):
    out = refine_predictors(min_measurements=8)
    assert out["promoted"] is False and "nothing retrained" in out["reason"]
    # a block instance, as @gogh_placed(registry=...) takes one (refused by the flow's parameter
    # validation before: "registry: Input should be a valid string", a review)
    from gogh_flows.flows.blocks import PredictorRegistry

    other = f"sqlite:///{gogh_home / 'other' / 'mlflow.db'}"
    out = refine_predictors(registry=PredictorRegistry(tracking_uri=other, prior="gavel"), min_measurements=8)
    assert out["promoted"] is False and "nothing retrained" in out["reason"]
    from gogh_flows.flows.predictors import PRIOR_ID_TAG, prior_id
    from gogh_flows.predict.io import prior_dir
    from gogh_flows.tracking.registry import ModelRegistry

    used = ModelRegistry(other)  # the block's store and prior, not the embedded default's
    assert used.version_tags("gogh-p1", used.version_for("gogh-p1", "champion"))[PRIOR_ID_TAG] == prior_id(
        prior_dir("gavel"))


def test_runs_starting_together_register_the_shipped_prior_once(gogh_home):
    """Eight sources (as eight flow runs starting at once) on an empty registry: one version each."""
    from concurrent.futures import ThreadPoolExecutor

    from gogh_flows.flows.blocks import PredictorRegistry
    from gogh_flows.flows.predictors import PredictorSource

    block = PredictorRegistry()
    with ThreadPoolExecutor(max_workers=8) as ex:
        list(ex.map(lambda _: PredictorSource(block).ensure_prior(), range(8)))
    reg = PredictorSource(block).registry
    for name in (block.p1_name, block.p2_name):
        assert reg.versions(name).height == 1, name
        assert reg.version_for(name, block.alias) == 1


def test_a_prior_is_registered_whole_or_not_at_all_and_never_beside_another_priors_half(gogh_home, gogh_models,
                                                                                            tmp_path, monkeypatch):
    """A prior whose P2 was damaged left its P1 champion and no P2, and the next start with the
    shipped prior gave that P1 a P2 it was not trained with, without a word (a review)."""
    from mlflow import MlflowClient

    from gogh_flows.flows.blocks import PredictorRegistry
    from gogh_flows.flows.predictors import PRIOR_ID_TAG, PredictorSource, prior_id
    from gogh_flows.predict.io import prior_dir

    shutil.copytree(gogh_models / "gavel", tmp_path / "ours")
    config = tmp_path / "ours" / "p2" / "config.json"
    text = config.read_text()
    config.write_text(text[: len(text) // 2])
    damaged = PredictorSource(PredictorRegistry(prior=str(tmp_path / "ours")))
    with pytest.raises(ValueError, match=r"cannot be registered: its p2/ does not load .*nothing was registered"):
        damaged.ensure_prior()
    assert damaged.registry._model_names() == []
    # the shipped prior registers both halves, tagged with the pair they make
    shipped = PredictorSource(PredictorRegistry())
    shipped.ensure_prior()
    pair = prior_id(prior_dir("synthetic"))
    for name in ("gogh-p1", "gogh-p2"):
        assert shipped.registry.version_tags(name, 1)[PRIOR_ID_TAG] == pair
    # its P2's alias gone (deleted by hand): another prior may not fill that half in
    MlflowClient(shipped.registry.tracking_uri).delete_registered_model_alias("gogh-p2", "champion")
    config.write_text(text)  # repaired: a whole prior, but not the one the registry's P1 came from
    with pytest.raises(ValueError, match=r"gogh-p1 v1 \(@champion\) .* is not from this PredictorRegistry's prior .*gogh-p2 from it would "
                                         r"pair models not trained together"):
        PredictorSource(PredictorRegistry(prior=str(tmp_path / "ours"))).ensure_prior()
    shipped.ensure_prior()  # the same prior may
    assert shipped.registry.version_for("gogh-p2", "champion") == 2


def test_a_half_registered_elsewhere_from_another_prior_while_this_process_waited_is_not_completed(gogh_home,
                                                                                                  monkeypatch):
    """Two hosts with different priors on one empty registry: the one that lost the race for P1
    must not add its own P2 beside the other's P1."""
    from gogh_flows.flows.blocks import PredictorRegistry
    from gogh_flows.flows.predictors import PRIOR_ID_TAG, PredictorSource, prior_id
    from gogh_flows.predict.io import prior_dir

    source = PredictorSource(PredictorRegistry())  # the synthetic prior
    real = source.registry.ensure_registered

    def racing(name, directory, **kwargs):
        if name == "gogh-p1":  # what the host that won registered, while this one waited for the alias
            return real(name, prior_dir("gavel") / "p1", **{**kwargs, "tags": {PRIOR_ID_TAG: prior_id(prior_dir("gavel"))}})
        return real(name, directory, **kwargs)

    monkeypatch.setattr(source.registry, "ensure_registered", racing)
    with pytest.raises(ValueError, match=r"gogh-p1 v1 \(@champion\) .* is not from this PredictorRegistry's prior .*registering gogh-p2 from it"):
        source.ensure_prior()
    assert source.registry.version_for("gogh-p2", "champion") is None


def test_a_prior_half_registered_before_the_tag_is_judged_by_its_weights(gogh_home):
    """Versions registered by an earlier gogh-flows carry no prior tag: the half missing is added
    beside one only if that one is the same prior's, by its weights (a code review)."""
    from gogh_flows.flows.blocks import PredictorRegistry
    from gogh_flows.flows.predictors import PredictorSource
    from gogh_flows.predict.io import prior_dir

    source = PredictorSource(PredictorRegistry())  # the synthetic prior
    source.registry.ensure_registered("gogh-p1", prior_dir("gavel") / "p1")  # untagged, another prior's
    with pytest.raises(ValueError, match=r"gogh-p1 v1 \(@champion\) .* is not from this PredictorRegistry's prior"):
        source.ensure_prior()
    assert source.registry.version_for("gogh-p2", "champion") is None
    same = PredictorSource(PredictorRegistry(p1_name="old-p1", p2_name="old-p2"))
    same.registry.ensure_registered("old-p1", prior_dir("synthetic") / "p1")  # untagged, this prior's
    same.ensure_prior()
    assert same.registry.version_for("old-p2", "champion") == 1


def test_a_prior_written_as_a_path_is_the_folder_not_a_shipped_name(gogh_models, tmp_path, monkeypatch):
    """docs/user-guide.md: "a shipped name wins over a folder of that name, so write `./gavel` for
    yours"; `gogh predict --predictors ./gavel` read the shipped one (a review)."""
    from gogh_flows.predict.io import prior_dir

    monkeypatch.setenv("GOGH_MODELS_DIR", str(gogh_models))
    shutil.copytree(gogh_models / "gavel", tmp_path / "gavel")
    monkeypatch.chdir(tmp_path)
    assert prior_dir("gavel") == gogh_models / "gavel"
    assert prior_dir("./gavel").resolve() == (tmp_path / "gavel").resolve()
    assert prior_dir(str(tmp_path / "gavel")) == tmp_path / "gavel"


def test_min_improvement_must_be_a_fraction(gogh_home):
    with pytest.raises(ValueError, match="min_improvement"):
        refine_predictors.fn(min_improvement=1.5)


def test_a_challenger_keeps_the_champions_ensemble_and_intervals(gogh_home, gogh_models):
    """Without them a promoted challenger would predict with P2 alone, and every placement at a
    risk level would stop for want of intervals."""
    import polars as pl

    from gogh_flows.flows.retrain import INHERITED, fit_challenger
    from gogh_flows.predict.io import load_p2

    champion = load_p2(gogh_models / "synthetic" / "p2")
    assert set(INHERITED) <= set(champion.trained_on)
    table = synthetic_table(GPUS)
    jobs = [j for j in table.job_types if all(table.isolated(j, g) > 0 for g in GPUS)][:6]
    obs = pl.DataFrame([{"job_type": j, "gpu_type": g, "partner": None, "throughput": table.isolated(j, g)}
                        for j in jobs for g in GPUS])
    p1 = predictor_source(PredictorRegistry()).get(force=True).p1
    from gogh_flows.predict.data import zoo_jobs

    p2, _ = fit_challenger(p1, zoo_jobs(jobs), obs, base=None, config=P2Config(epochs=5, seed=0), gpu_types=GPUS,
                           validation_fraction=0.25, inherit=champion.trained_on)
    for key in INHERITED:
        assert p2.trained_on[key] == champion.trained_on[key]
    assert p2.trained_on["observations"] == obs.height  # its own record otherwise
    from gogh_flows.predict.service import ThroughputPredictor

    assert ThroughputPredictor(p1, p2).ensemble is not None


def test_a_refit_that_predicts_the_validation_runs_worse_keeps_the_champions_weights(gogh_home, gogh_models):
    """A refit on a few runs can undo what the champion knew; the challenger is then the
    champion's weights with this fleet's new site offsets, and says so."""
    import polars as pl

    from gogh_flows.flows.retrain import fit_challenger
    from gogh_flows.predict.data import zoo_jobs
    from gogh_flows.predict.io import load_p2

    champion = load_p2(gogh_models / "synthetic" / "p2")
    table = synthetic_table(GPUS, boards={"v100": "v100-pcie"})  # this fleet's V100s are PCIe boards
    jobs = [j for j in table.job_types if all(table.isolated(j, g) > 0 for g in GPUS)][:16]
    obs = pl.DataFrame([{"job_type": j, "gpu_type": g, "partner": None, "throughput": table.isolated(j, g)}
                        for j in jobs for g in ("v100", "a100")])
    p1 = predictor_source(PredictorRegistry()).get(force=True).p1
    # 5 epochs from scratch: a refit that cannot be as good as the shipped weights
    p2, n_val = fit_challenger(p1, zoo_jobs(jobs), obs, base=None, config=P2Config(epochs=5, seed=0), gpu_types=GPUS,
                               validation_fraction=0.25, inherit=champion.trained_on, champion=champion)
    choice = p2.trained_on["weights_validation_mape"]
    assert p2.trained_on["weights"] == "the champion's" and n_val == 8  # enough runs to judge a refit
    assert set(choice) == {"refitted", "the champion's"} and p2.trained_on["weights_reason"].startswith(
        "the refit was not 1% better on 8 validation runs")
    assert p2.layout == champion.layout and p2.trust_scale == champion.trust_scale
    assert p2.trained_on["site_offsets"]["unmeasured"]["v100"] < 0  # learned: the V100s run slower
    assert "site_offsets" not in champion.trained_on  # the champion itself is left as it was
    # fewer validation runs than that do not judge a refit at all
    few, n_few = fit_challenger(p1, zoo_jobs(jobs), obs.head(12), base=None, config=P2Config(epochs=5, seed=0),
                                gpu_types=GPUS, validation_fraction=0.25, inherit=champion.trained_on, champion=champion)
    assert n_few == 3 and few.trained_on["weights"] == "the champion's" and few.trained_on["weights_validation_mape"] == {}
    # shipped weights never learned this fleet's cross-type pattern: the offsets move measured jobs too
    assert few.trained_on["site_offsets"]["anchored"] is True


def test_a_teams_own_trained_predictors_serve_flow_runs_and_retrain(gogh_home, gogh_models, tmp_path, monkeypatch):
    """`gogh predictors train --out DIR` wrote predictors nothing could use in flow runs:
    PredictorRegistry(prior=...) took only the shipped names. A folder holding p1/ and p2/, given
    relative to where the block is made, is stored absolute (a block is loaded by processes started
    elsewhere), registered on first use, and retraining learns from the truth its refiner was
    trained on; a folder without p2/ is refused, and a shipped name wins over a folder of that name."""
    import shutil

    from gogh_flows.flows.blocks import PredictorRegistry
    from gogh_flows.flows.predictors import PredictorSource
    from gogh_flows.flows.retrain import base_measurements

    monkeypatch.setenv("GOGH_MODELS_DIR", str(gogh_models))  # the shipped priors are there too
    shutil.copytree(gogh_models / "synthetic", tmp_path / "ours")
    monkeypatch.chdir(tmp_path)
    block = PredictorRegistry(prior="ours")
    assert block.prior == str((tmp_path / "ours").resolve())
    monkeypatch.chdir(gogh_home.parent)  # another working directory: the stored block still loads
    assert PredictorRegistry.model_validate(block.model_dump()).prior == block.prior
    source = PredictorSource(block)
    source.ensure_prior()
    for name in (block.p1_name, block.p2_name):
        assert source.registry.version_for(name, block.alias) == 1, name
    assert source.get(force=True, bounded=False) is not None
    # the copy's refiner was trained on the synthetic truth: retraining keeps learning from it
    base = base_measurements("prior", block.prior, ["v100", "k80"])
    assert base is not None and base.iso.height > 0
    shutil.rmtree(tmp_path / "ours" / "p2")
    with pytest.raises(ValueError, match="nor a folder holding p1/ and p2/"):
        PredictorRegistry(prior=str(tmp_path / "ours"))
    (tmp_path / "synthetic" / "p1").mkdir(parents=True)
    (tmp_path / "synthetic" / "p2").mkdir()
    monkeypatch.chdir(tmp_path)
    assert PredictorRegistry(prior="synthetic").prior == "synthetic"  # the shipped one; ./synthetic for the folder


def test_a_prior_given_to_a_registry_with_another_priors_champion_is_said_not_to_be_used(
        gogh_home, gogh_models, tmp_path, monkeypatch, caplog):
    """PredictorRegistry(prior=DIR) on a registry that already had the synthetic prior's champion was
    ignored without a word: runs were placed with the champion while the user believed their own
    prior in use (a review). Said once; the champion's own prior says nothing."""
    import logging

    from gogh_flows.flows.blocks import PredictorRegistry
    from gogh_flows.flows.predictors import PredictorSource

    monkeypatch.setenv("GOGH_MODELS_DIR", str(gogh_models))
    first = PredictorSource(PredictorRegistry(prior="synthetic"))
    first.ensure_prior()
    shutil.copytree(gogh_models / "gavel", tmp_path / "ours")
    with caplog.at_level(logging.WARNING, logger="gogh_flows"):
        PredictorSource(PredictorRegistry(prior="synthetic")).ensure_prior()
        assert "is not what runs are placed with" not in caplog.text
        other = PredictorSource(PredictorRegistry(prior=str(tmp_path / "ours")))
        other.ensure_prior()
        other.ensure_prior()
    said = [r.getMessage() for r in caplog.records if "is not what runs are placed with" in r.getMessage()]
    assert len(said) == 1, said
    assert "already has a champion under @" in said[0] and "another alias" in said[0]
    assert other.registry.version_for(other.block.p1_name, other.block.alias) == 1  # nothing registered


def test_a_prior_trained_on_a_relative_gavel_path_retrains_on_it_from_any_folder(gavel_dir, tmp_path, monkeypatch,
                                                                                     caplog):
    """The shipped Gavel prior records its truth as `../shared/data/gavel/simulation_throughputs.json`,
    typed where it was trained: a retraining started from any other folder (a `gogh serve`
    process, a Prefect worker) logged that it could not read it and learned from the logged runs
    alone. It is found by its file name in the Gavel data folder."""
    import json
    from pathlib import Path

    from gogh_flows.flows.retrain import base_measurements
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.truth import load_truth

    shutil.copytree(Path(__file__).resolve().parent.parent / "models" / "gavel", tmp_path / "ours")
    recorded = json.loads((tmp_path / "ours" / "p2" / "config.json").read_text())["trained_on"]["truth"]
    assert not Path(recorded).is_absolute() and recorded != "gavel"  # the case: a path as typed
    monkeypatch.setenv("GOGH_GAVEL_DIR", str(gavel_dir))
    monkeypatch.chdir(tmp_path)  # where that relative path leads nowhere
    assert not Path(recorded).exists()
    base = base_measurements("prior", str(tmp_path / "ours"), ["k80", "p100", "v100"])
    assert base is not None
    assert base.iso.height == MeasuredSet.from_table(load_truth("gavel")).iso.height
    # where the data is not on this machine, a folder prior's retraining learns from its runs alone, as
    # before, and says so (a review: found by name as 'gavel', it raised as if the user had named it)
    import logging

    monkeypatch.setenv("GOGH_GAVEL_DIR", str(tmp_path / "no-data-here"))
    with caplog.at_level(logging.WARNING, logger="gogh_flows"):
        assert base_measurements("prior", str(tmp_path / "ours"), ["k80", "p100", "v100"]) is None
    assert "the challenger learns from the logged runs alone" in caplog.text
    with pytest.raises(FileNotFoundError):  # the shipped prior by name, or 'gavel' named: still must be read
        base_measurements("gavel", None, ["k80", "p100", "v100"])


def test_a_retraining_that_could_not_load_the_registrys_champion_judges_nothing(gogh_home, tmp_path, caplog):
    """A registry blip as the retraining read its champion left this process with the version
    it had loaded before (v2), while the registry's champion was v1: the challenger was judged
    against v2 and promoted over v1, which it never faced (an operator's review)."""
    from mlflow.exceptions import MlflowException

    from gogh_flows.tracking.registry import ModelRegistry

    _weak_champion(tmp_path)  # this (serving) process has loaded v2
    _log_measurements()
    ModelRegistry(PredictorRegistry().resolved_tracking_uri()).set_alias("gogh-p2", "champion", 1)  # elsewhere
    source = predictor_source(PredictorRegistry())
    real, calls = source.registry.version_for, []

    def blip(name, alias):
        calls.append(name)
        if len(calls) == 1:
            raise MlflowException("connection reset by peer")
        return real(name, alias)

    source.registry.version_for = blip
    try:
        out = refine_predictors(base_data="none", epochs=60)
    finally:
        source.registry.version_for = real
    assert out["promoted"] is False and out["champion_version"] == 1
    assert "(P1 v1, P2 v1) is not the one loaded here" in out["reason"] and "nothing retrained" in out["reason"]
    assert real("gogh-p2", "champion") == 1 and real("gogh-p2", "challenger") is None


def test_a_better_challenger_whose_promotion_failed_is_promoted_by_the_next_retraining(gogh_home, tmp_path):
    """MLflow failed between registering a better challenger and moving the alias: the next
    retraining found "nothing new" and a quiet fleet never promoted it (an operator's review)."""
    from mlflow.exceptions import MlflowException

    weak = _weak_champion(tmp_path)
    _log_measurements()
    source = predictor_source(PredictorRegistry())
    real = source.registry.set_alias

    def down(name, alias, version):
        if alias == "champion":
            raise MlflowException("503 Service Unavailable (MLflow restarting)")
        return real(name, alias, version)

    source.registry.set_alias = down
    try:
        with pytest.raises(MlflowException, match="503"):
            refine_predictors(base_data="none", epochs=60)
    finally:
        source.registry.set_alias = real
    challenger = source.registry.version_for("gogh-p2", "challenger")
    assert source.registry.version_for("gogh-p2", "champion") == weak and challenger != weak
    again = refine_predictors(base_data="none", epochs=60)
    assert again["promoted"] is True and again["champion_version"] == challenger
    assert "was not promoted then; promoted to champion now" in again["reason"]
    assert source.registry.version_for("gogh-p2", "champion") == challenger
    third = refine_predictors(base_data="none", epochs=60)  # nothing new, and nothing to promote again
    assert third["promoted"] is False and "nothing retrained" in third["reason"]


def test_a_champion_rolled_back_by_hand_stays_rolled_back(gogh_home, tmp_path):
    """An operator moved the champion alias back to the version a promoted challenger replaced;
    the next retraining, with nothing new to learn, promoted the challenger again and said its
    promotion had "not happened then" (an MLflow review)."""
    weak = _weak_champion(tmp_path)
    _log_measurements()
    first = refine_predictors(base_data="none", epochs=60)
    assert first["promoted"] is True
    source = predictor_source(PredictorRegistry())
    promoted = first["challenger_version"]
    assert source.registry.version_tags("gogh-p2", promoted)["gogh.promoted"] == "true"
    source.registry.set_alias("gogh-p2", "champion", weak)  # the documented rollback
    again = refine_predictors(base_data="none", epochs=60)
    assert again["promoted"] is False and again["champion_version"] == weak
    assert f"promoted to champion and since replaced by v{weak}" in again["reason"], again["reason"]
    assert source.registry.version_for("gogh-p2", "champion") == weak


def test_a_p1_moved_by_hand_while_the_challenger_trained_stops_its_promotion(gogh_home, tmp_path, monkeypatch,
                                                                             gogh_models):
    """Only the P2 alias was checked before promoting: a P1 promoted by hand meanwhile left the
    fleet loading a pair never trained nor scored together (an operator's review)."""
    from gogh_flows.flows import retrain

    _weak_champion(tmp_path)
    _log_measurements()
    source = predictor_source(PredictorRegistry())
    real_base = retrain.base_measurements

    def base_and_move(*args, **kwargs):  # a person promotes another P1 while the challenger trains
        source.registry.register("gogh-p1", gogh_models / "gavel" / "p1", alias="champion")
        return real_base(*args, **kwargs)

    monkeypatch.setattr(retrain, "base_measurements", base_and_move)
    out = refine_predictors(base_data="none", epochs=60)
    assert out["promoted"] is False and "the champion moved from P1 v1" in out["reason"]


def test_runs_on_a_gpu_type_this_machine_does_not_know_are_left_out_not_a_failure(gogh_home, caplog):
    """A type registered on another placing machine (register_gpu_type) reaches every machine
    through the shared store: one such run made every retraining fail (an operator's review)."""
    import logging

    from gogh_flows.tracking.measurements import Measurement, MeasurementLog

    _log_measurements()
    log = MeasurementLog(PredictorRegistry().resolved_tracking_uri(), state_dir() / "measurements")
    log.log(Measurement(run_id="elsewhere", flow_name="t", job_type="ResNet-50 (batch size 64)", family=None,
                        batch_size=None, gpu_id="l40s-0", gpu_type="l40s-custom", device="l40s-0", partners=(),
                        required_throughput=1.0, predicted_throughput=None, steps=100.0, duration_s=10.0,
                        throughput=10.0, mean_power_w=100.0, energy_j=1000.0, status="completed",
                        telemetry="emulated", started_at=time.time()))
    with caplog.at_level(logging.WARNING):
        out = refine_predictors(base_data="none", epochs=30)
    assert "challenger_version" in out
    assert "l40s-custom (added on another machine with register_gpu_type" in caplog.text


def test_min_measurements_below_two_is_refused(gogh_home):
    with pytest.raises(ValueError, match="min_measurements must be at least 2"):
        refine_predictors.fn(min_measurements=1)
