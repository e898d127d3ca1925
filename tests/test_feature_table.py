"""What zero does not do is written once (zero/features.py, see [Note: the feature table]): the stand-in
reasons, the facade's refused engine methods, the refused optimizers and the migration guide's table
come from it, and no reason anywhere denies a feature zero has."""
import re
from pathlib import Path

import pytest

from zero.features import FEATURES, IMPLEMENTED, absent_packages, markdown_table, refused_engine_methods

ROOT = Path(__file__).resolve().parents[1]


def _every_reason() -> dict[str, str]:
    """Every sentence zero gives for something it does not do, by where it is given."""
    from zero.config.features import UNIMPLEMENTED_FEATURES
    from zero.deepspeed._missing import ABSENT_NAMES, ABSENT_PACKAGES, GENERAL_REASON
    from zero.deepspeed.engine_methods import NOT_AVAILABLE
    from zero.optim.choice import _WHOLE_TENSOR

    reasons = {f"feature {f.name}": f.reason for f in FEATURES}
    reasons.update({f"config key {row.path}": row.reason for row in UNIMPLEMENTED_FEATURES})
    reasons.update({f"package {k}": v for k, v in ABSENT_PACKAGES.items()})
    reasons.update({f"name {k}": v for k, v in ABSENT_NAMES.items()})
    reasons.update({f"engine.{k}": v for k, v in NOT_AVAILABLE.items()})
    reasons.update({f"optimizer {k}": v for k, v in _WHOLE_TENSOR.items()})
    reasons["the general reason"] = GENERAL_REASON
    return reasons


def test_no_reason_denies_a_feature_zero_has():
    stale = []
    for where, reason in _every_reason().items():
        for feature in IMPLEMENTED:
            f = re.escape(feature)
            denial = rf"\b{f}\b[^.;:]*\b(is|are) not (implemented|supported|provided)|\bknows no {f}|\bno {f}\b"
            if re.search(denial, reason, re.IGNORECASE):
                stale.append(f"{where}: {reason}")
    assert not stale, "\n".join(stale)


def test_the_stand_ins_refusals_and_optimizers_come_from_the_one_table():
    from zero.deepspeed._missing import ABSENT_PACKAGES
    from zero.deepspeed.engine_methods import NOT_AVAILABLE
    from zero.optim.choice import _WHOLE_TENSOR

    assert ABSENT_PACKAGES == absent_packages() and NOT_AVAILABLE == refused_engine_methods()
    assert _WHOLE_TENSOR == {o: f.reason for f in FEATURES for o in f.optimizers}
    import zero

    for method in NOT_AVAILABLE:  # refused by the facade, not defined by zero's engine
        assert not hasattr(zero.Engine, method), method


def test_a_features_config_keys_are_refused_or_warned_about_by_the_config():
    from zero.config import ConfigError, ConfigWarning, load_config
    from zero.config.features import UNIMPLEMENTED_FEATURES
    from zero.features import config_keys

    rows = {row.path: row for row in UNIMPLEMENTED_FEATURES}
    assert config_keys() and set(config_keys()) <= set(rows), set(config_keys()) - set(rows)
    # and the config does refuse (or warn about) one when it is set
    with pytest.raises(ConfigError, match="compression_training"):
        load_config({"train_micro_batch_size_per_gpu": 1, "compression_training": {"weight_quantization": {
            "shared_parameters": {"enabled": True}}}})
    with pytest.warns(ConfigWarning, match="aio.use_gds"):
        load_config({"train_micro_batch_size_per_gpu": 1, "aio": {"block_size": 1048576, "use_gds": True}})


def test_the_migration_guide_shows_the_table():
    guide = (ROOT / "docs" / "migrating-from-deepspeed.md").read_text()
    assert markdown_table() in guide, "run `python -m zero.features` and paste its table into the guide"


def test_an_import_probe_takes_the_missing_branch_for_a_feature_zero_lacks():
    try:
        import zero.deepspeed.moe.layer  # noqa: F401
        found = True
    except ImportError as e:
        found, said = False, str(e)
    assert not found and "deepspeed.moe is not available in zero: expert parallelism is not implemented" in said
    import zero.deepspeed as deepspeed

    assert not hasattr(deepspeed, "moe") and hasattr(deepspeed, "zero")
