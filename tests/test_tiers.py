"""GPU tiers: the model table, NVML-name matching, scores, tier boundaries and host adjustments."""

from __future__ import annotations

import importlib.resources
import tomllib

import pytest

from master.services.market.tiers import (
    CONSUMER_MIN_GIB,
    CONSUMER_MIN_SCORE,
    DATACENTER_MIN_SCORE,
    FLAGSHIP_MIN_SCORE,
    PROSUMER_MIN_GIB,
    PROSUMER_MIN_SCORE,
    REQUIRED_FIELDS,
    WORKSTATION_DATACENTER_MIN_GIB,
    GpuModel,
    Segment,
    Tier,
    classify,
    load_models,
    match_model,
    parse_models,
    spec_score,
    tier_for,
)
from shared.errors import ConfigError, ValidationFailed

MODELS = list(load_models())
EPSILON = 0.1  # scores are rounded to 0.1


def mib(gib: float) -> int:
    return int(gib * 1024)


def score_of(key: str) -> float:
    return spec_score(load_models()[key])


def entry(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "key": "test-gpu",
        "names": ["Test GPU"],
        "architecture": "Ampere",
        "segment": "consumer",
        "memory_gib": 8,
        "memory_bandwidth_gbs": 400,
        "fp32_tflops": 10.0,
        "tensor_fp16_tflops": 40.0,
        "launch_year": 2021,
    }
    base.update(overrides)
    return base


class TestModelTable:
    """The packaged TOML loads, every entry is complete, and bad tables are refused by name."""

    def test_packaged_toml_has_every_required_field(self) -> None:
        """Each [[gpu]] in the packaged file carries every required field."""
        text = (
            importlib.resources.files("master").joinpath("data/gpu_models.toml").read_text(encoding="utf-8")
        )
        entries = tomllib.loads(text)["gpu"]
        assert len(entries) == len(MODELS) >= 40
        for raw in entries:
            assert set(REQUIRED_FIELDS) <= set(raw), raw.get("key")

    def test_covers_the_models_the_marketplace_lists(self) -> None:
        """The table holds at least the consumer, workstation and datacenter models we promised."""
        keys = {model.key for model in MODELS}
        expected = {
            "gtx-1060-6gb", "gtx-1070", "gtx-1080", "gtx-1080-ti",
            "rtx-2060", "rtx-2070", "rtx-2080", "rtx-2080-ti",
            "rtx-3060", "rtx-3070", "rtx-3080", "rtx-3090",
            "rtx-4060", "rtx-4070", "rtx-4080", "rtx-4080-super", "rtx-4090", "rtx-5080", "rtx-5090",
            "rtx-a4000", "rtx-a5000", "rtx-a6000", "rtx-6000-ada",
            "t4", "v100-sxm2-16gb", "v100-sxm2-32gb", "a10", "a30", "a40",
            "a100-pcie-40gb", "a100-sxm4-80gb", "l4", "l40s", "h100-pcie", "h100-sxm", "h200", "b200",
        }  # fmt: skip
        assert expected <= keys

    def test_values_are_plausible(self) -> None:
        """Every model has positive memory, bandwidth and FP32 and a launch year in the CUDA era."""
        for model in MODELS:
            assert model.memory_gib > 0 and model.memory_bandwidth_gbs > 0 and model.fp32_tflops > 0, (
                model.key
            )
            assert 2016 <= model.launch_year <= 2026, model.key

    def test_missing_field_is_refused_naming_entry_and_field(self) -> None:
        """An entry without a required field raises ConfigError naming the entry and the field."""
        broken = entry()
        del broken["memory_bandwidth_gbs"]
        with pytest.raises(ConfigError, match=r"test-gpu.*memory_bandwidth_gbs"):
            parse_models({"gpu": [broken]})

    def test_bad_segment_and_duplicate_names_are_refused(self) -> None:
        """An unknown segment, or one NVML name given to two models, raises ConfigError."""
        with pytest.raises(ConfigError, match=r"[Ss]egment"):
            parse_models({"gpu": [entry(segment="gaming")]})
        with pytest.raises(ConfigError, match="already names"):
            parse_models({"gpu": [entry(), entry(key="other", names=["TEST-GPU"])]})


class TestMatchModel:
    """NVML names, with their prefixes, suffixes and spellings, find the right model."""

    @pytest.mark.parametrize("model", MODELS, ids=lambda m: m.key)
    def test_every_model_matches_its_own_names(self, model: GpuModel) -> None:
        """Each name listed for a model matches that model, with or without a memory reading."""
        for name in model.names:
            assert match_model(name, mib(model.memory_gib)) == model
            assert match_model(name, None) == model
            assert match_model(name.upper(), None) == model

    @pytest.mark.parametrize(
        ("name", "memory_gib", "key"),
        [
            ("NVIDIA A100-SXM4-80GB", 80, "a100-sxm4-80gb"),
            ("NVIDIA A100-PCIE-40GB", 40, "a100-pcie-40gb"),
            ("NVIDIA A100 80GB PCIe", 80, "a100-pcie-80gb"),
            ("Tesla V100-SXM2-32GB", 32, "v100-sxm2-32gb"),
            ("Tesla V100-SXM2-16GB", 16, "v100-sxm2-16gb"),
            ("NVIDIA GeForce RTX 4080 SUPER", 16, "rtx-4080-super"),
            ("NVIDIA GeForce RTX 4080", 16, "rtx-4080"),
            ("NVIDIA H100 80GB HBM3", 80, "h100-sxm"),
            ("NVIDIA H100 PCIe", 80, "h100-pcie"),
            ("NVIDIA A10", 24, "a10"),
            ("GeForce RTX 3090", 24, "rtx-3090"),
            ("nvidia geforce rtx-4090", 24, "rtx-4090"),
            ("RTX4090", 24, "rtx-4090"),
            ("NVIDIA RTX A6000", 48, "rtx-a6000"),
            ("NVIDIA T4", 16, "t4"),
        ],
    )
    def test_tricky_names(self, name: str, memory_gib: int, key: str) -> None:
        """Real NVML spellings resolve to the model their suffixes and words describe."""
        model = match_model(name, mib(memory_gib))
        assert model is not None and model.key == key

    def test_a10_never_matches_a100_and_back(self) -> None:
        """ "A10" and "A100" are different models whatever memory is reported."""
        for memory_gib in (24, 40, 80):
            a10 = match_model("NVIDIA A10", mib(memory_gib))
            assert a10 is not None and a10.key == "a10"
            a100 = match_model("NVIDIA A100", mib(memory_gib))
            assert a100 is not None and a100.key.startswith("a100")

    def test_memory_picks_the_variant_when_the_name_does_not(self) -> None:
        """A bare "A100" or "V100-SXM2" is told apart by the memory NVML reports."""
        assert (m := match_model("NVIDIA A100", 81251)) is not None and m.memory_gib == 80
        assert (m := match_model("NVIDIA A100", 40536)) is not None and m.memory_gib == 40
        assert (m := match_model("NVIDIA A100-SXM4", 40536)) is not None and m.key == "a100-sxm4-40gb"
        assert (m := match_model("Tesla V100-SXM2", 32510)) is not None and m.key == "v100-sxm2-32gb"
        assert (m := match_model("Tesla V100-SXM2", 16160)) is not None and m.key == "v100-sxm2-16gb"

    def test_unknown_and_near_miss_names_match_nothing(self) -> None:
        """A model outside the table, or a sibling of one (3060 Ti), is not guessed."""
        assert match_model("NVIDIA GeForce RTX 3060 Ti", mib(8)) is None
        assert match_model("AMD Instinct MI300X", mib(192)) is None
        assert match_model("", None) is None
        assert match_model("NVIDIA", None) is None


class TestTierBoundaries:
    """Each boundary puts a GPU just above it in the higher tier and just below it in the lower."""

    def classified(self, key: str) -> Tier:
        model = load_models()[key]
        return classify(model.names[0], mib(model.memory_gib)).tier

    def test_flagship_boundary(self) -> None:
        """Datacenter GPUs at or above the flagship score are flagship; below it, datacenter."""
        assert tier_for(FLAGSHIP_MIN_SCORE, Segment.DATACENTER, 80)[0] is Tier.FLAGSHIP
        assert tier_for(FLAGSHIP_MIN_SCORE - EPSILON, Segment.DATACENTER, 80)[0] is Tier.DATACENTER
        assert tier_for(FLAGSHIP_MIN_SCORE + 30, Segment.CONSUMER, 32)[0] is Tier.PROSUMER  # never flagship
        assert self.classified("h100-pcie") is Tier.FLAGSHIP
        assert self.classified("a100-sxm4-80gb") is Tier.DATACENTER

    def test_datacenter_boundary(self) -> None:
        """Datacenter GPUs and big workstation GPUs are datacenter from the minimum score up."""
        assert tier_for(DATACENTER_MIN_SCORE, Segment.DATACENTER, 16)[0] is Tier.DATACENTER
        assert tier_for(DATACENTER_MIN_SCORE - EPSILON, Segment.DATACENTER, 16)[0] is Tier.ENTRY
        big = WORKSTATION_DATACENTER_MIN_GIB
        assert tier_for(30, Segment.WORKSTATION, big)[0] is Tier.DATACENTER
        assert tier_for(30, Segment.WORKSTATION, big - 1)[0] is Tier.PROSUMER
        assert self.classified("t4") is Tier.DATACENTER
        assert self.classified("rtx-a6000") is Tier.DATACENTER
        assert self.classified("rtx-a4000") is Tier.CONSUMER

    @pytest.mark.parametrize(
        ("tier", "min_score", "min_gib", "extra_score", "gib_short", "below", "models"),
        [
            # Prosumer needs both the score and the memory; missing either drops to consumer.
            pytest.param(
                Tier.PROSUMER, PROSUMER_MIN_SCORE, PROSUMER_MIN_GIB, 10, 4, Tier.CONSUMER,
                {"rtx-3090": Tier.PROSUMER, "rtx-4090": Tier.PROSUMER, "rtx-3080": Tier.CONSUMER}, id="prosumer",
            ),
            # Consumer needs the score and 8 GiB; below either it is entry.
            pytest.param(
                Tier.CONSUMER, CONSUMER_MIN_SCORE, CONSUMER_MIN_GIB, 5, 2, Tier.ENTRY,
                {"gtx-1080-ti": Tier.CONSUMER, "gtx-1080": Tier.ENTRY, "rtx-2060": Tier.ENTRY}, id="consumer",
            ),
        ],
    )
    def test_score_and_memory_boundary(
        self, tier: Tier, min_score: float, min_gib: float, extra_score: float, gib_short: float, below: Tier,
        models: dict[str, Tier],
    ) -> None:
        """A tier that needs both a score and an amount of memory drops to the tier below when either is missing."""
        assert tier_for(min_score, Segment.CONSUMER, min_gib)[0] is tier
        assert tier_for(min_score - EPSILON, Segment.CONSUMER, min_gib)[0] is below
        assert tier_for(min_score + extra_score, Segment.CONSUMER, min_gib - gib_short)[0] is below
        for model, expected in models.items():
            assert self.classified(model) is expected

    def test_every_model_gets_a_tier_and_a_reason(self) -> None:
        """Known models classify without review and say which rule placed them."""
        for model in MODELS:
            result = classify(model.names[0], mib(model.memory_gib))
            assert result.model_key == model.key and not result.needs_review
            assert result.reasons[-1].startswith(result.tier.value)


class TestAdjustments:
    """A poor PCIe link, slow network or low reliability lowers the score, can move the tier, and says so."""

    def test_each_adjustment_lowers_the_score_and_is_listed(self) -> None:
        """Each bad reading multiplies the score down and adds a reason naming it."""
        base = classify(
            "NVIDIA GeForce RTX 4090",
            mib(24),
            pcie_gen=4,
            pcie_width=16,
            network_down_mbps=1000,
            reliability=0.99,
        )
        cases: list[tuple[dict[str, float], str]] = [
            ({"pcie_gen": 2, "pcie_width": 8}, "PCIe gen2 x8"),
            ({"pcie_gen": 3, "pcie_width": 4}, "PCIe gen3 x4"),
            ({"network_down_mbps": 50}, "network download 50 Mbps"),
            ({"reliability": 0.8}, "reliability 0.8"),
        ]
        for bad, reason in cases:
            readings: dict[str, float] = {
                "pcie_gen": 4,
                "pcie_width": 16,
                "network_down_mbps": 1000,
                "reliability": 0.99,
            }
            readings.update(bad)
            adjusted = classify(
                "NVIDIA GeForce RTX 4090",
                mib(24),
                pcie_gen=int(readings["pcie_gen"]),
                pcie_width=int(readings["pcie_width"]),
                network_down_mbps=readings["network_down_mbps"],
                reliability=readings["reliability"],
            )
            assert adjusted.score < base.score, bad
            assert any(reason in line for line in adjusted.reasons), adjusted.reasons
        assert base.score == round(score_of("rtx-4090"), 1)

    def test_gen4_x4_is_as_good_as_gen3_x8(self) -> None:
        """The link is judged by bandwidth, so an equivalent narrower, newer link is not penalised."""
        assert classify("NVIDIA H100 PCIe", mib(80), pcie_gen=4, pcie_width=4).score == round(
            score_of("h100-pcie"), 1
        )

    def test_adjustments_can_move_the_tier(self) -> None:
        """A flagship on a slow network, and a prosumer card on an unreliable host, drop a tier."""
        h100 = classify("NVIDIA H100 PCIe", mib(80), network_down_mbps=50)
        assert h100.tier is Tier.DATACENTER
        rtx3090 = classify("NVIDIA GeForce RTX 3090", mib(24), reliability=0.5)
        assert rtx3090.tier is Tier.CONSUMER
        t4 = classify("Tesla T4", mib(16), pcie_gen=1, pcie_width=1, network_down_mbps=10, reliability=0.5)
        assert t4.tier is Tier.ENTRY and len(t4.reasons) == 5

    def test_adjustments_stack(self) -> None:
        """Two bad readings lower the score further than either alone."""
        one = classify("NVIDIA H100 80GB HBM3", mib(80), network_down_mbps=10)
        both = classify("NVIDIA H100 80GB HBM3", mib(80), network_down_mbps=10, reliability=0.5)
        assert both.score < one.score < 100

    def test_impossible_readings_are_refused(self) -> None:
        """Reliability outside 0..1, negative memory or a zero-lane link raise ValidationFailed."""
        with pytest.raises(ValidationFailed, match="reliability"):
            classify("NVIDIA L4", mib(24), reliability=1.5)
        with pytest.raises(ValidationFailed, match="memory_mib"):
            classify("NVIDIA L4", -1)
        with pytest.raises(ValidationFailed, match="pcie_width"):
            classify("NVIDIA L4", mib(24), pcie_gen=4, pcie_width=0)


class TestUnknownModels:
    """A GPU outside the table is estimated from memory and clock, flagged for review, never refused."""

    def test_unknown_model_is_classified_and_flagged(self) -> None:
        """An unknown 24 GiB card gets a tier, a score and needs_review."""
        result = classify("NVIDIA GeForce RTX 9090 Hyper", mib(24), max_sm_clock_mhz=1800)
        assert result.needs_review and result.model_key is None
        assert result.score == 24.0 and result.tier is Tier.CONSUMER
        assert "unknown model" in result.reasons[0]

    def test_clock_scales_the_estimate_within_bounds(self) -> None:
        """A faster clock raises the estimate, clamped, and the estimate never reaches flagship."""
        slow = classify("Mystery GPU", mib(24), max_sm_clock_mhz=900)
        fast = classify("Mystery GPU", mib(24), max_sm_clock_mhz=10_000)
        assert slow.score < fast.score <= 40
        huge = classify("Mystery GPU", mib(1024), max_sm_clock_mhz=3000)
        assert huge.tier is Tier.PROSUMER and huge.score == 40

    def test_nothing_known_still_classifies(self) -> None:
        """No name, no memory and no clock still yield an entry-tier result instead of an error."""
        result = classify("", None)
        assert result.tier is Tier.ENTRY and result.needs_review and result.score == 0

    def test_reported_memory_far_from_spec_needs_review(self) -> None:
        """A known name with implausible memory is classified from the spec but flagged."""
        result = classify("NVIDIA GeForce RTX 4090", mib(8))
        assert result.model_key == "rtx-4090" and result.needs_review
        assert any("differs from the spec" in line for line in result.reasons)


class TestScoreOrdering:
    """Scores rank generations the way renters experience them."""

    def test_reference_scores_100(self) -> None:
        """The H100 SXM is the reference."""
        assert score_of("h100-sxm") == pytest.approx(100)

    def test_datacenter_generations_are_ordered(self) -> None:
        """B200 > H200 > H100 > A100 > V100 > T4."""
        keys = ["b200", "h200", "h100-sxm", "a100-sxm4-80gb", "v100-sxm2-32gb", "t4"]
        scores = [score_of(key) for key in keys]
        assert scores == sorted(scores, reverse=True)

    def test_consumer_generations_are_ordered(self) -> None:
        """5090 > 4090 > 3090 > 3060, and 4080 SUPER > 4080."""
        keys = ["rtx-5090", "rtx-4090", "rtx-3090", "rtx-3060"]
        scores = [score_of(key) for key in keys]
        assert scores == sorted(scores, reverse=True)
        assert score_of("rtx-4080-super") > score_of("rtx-4080")
        assert score_of("a100-sxm4-80gb") > score_of("a100-pcie-40gb")
