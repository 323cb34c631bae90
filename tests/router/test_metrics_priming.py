"""Series whose labels are known in advance exist at 0 before any request (router/metrics.py `prime`)."""

from router.metrics import OBSERVED_LEGS, RouterMetrics


def test_prime_creates_latency_histograms_at_zero() -> None:
    """A histogram series created by its first observation is first scraped with that count in it, which rate()
    cannot see as an increase: the latency, leg and overhead histograms of every pool (and served model) must
    already be exposed at 0."""
    metrics = RouterMetrics()
    metrics.prime(["tp", "dcp"], ["kimi"])
    text = metrics.render().decode()
    for pool in ("tp", "dcp"):
        for name in ("time_to_first_token", "time_per_output_token", "inter_token_latency", "e2e_request_latency"):
            assert f'pdcluster_{name}_seconds_count{{model="kimi",pool="{pool}"}} 0.0' in text
        for leg in OBSERVED_LEGS:
            assert f'pdcluster_leg_duration_seconds_count{{leg="{leg}",pool="{pool}"}} 0.0' in text
        assert f'pdcluster_router_overhead_seconds_count{{pool="{pool}"}} 0.0' in text
    assert 'model="other"' not in text  # only the models it was told about


def test_prime_without_models_leaves_model_histograms_to_first_use() -> None:
    metrics = RouterMetrics()
    metrics.prime(["tp"])
    text = metrics.render().decode()
    assert "pdcluster_time_to_first_token_seconds_count{" not in text
    assert 'pdcluster_router_overhead_seconds_count{pool="tp"} 0.0' in text
