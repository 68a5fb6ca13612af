"""The Optuna study of a sweep, kept in the sweep directory: optuna 2's sqlite RDBStorage under SQLAlchemy 2."""

from __future__ import annotations

import logging
from pathlib import Path

import alembic.config
import alembic.migration
import alembic.script
import optuna.storages._rdb.storage as rdb
import sqlalchemy
from optuna.storages import RDBStorage
from optuna.storages._cached_storage import _CachedStorage


def storage(url: str):
    """optuna.create_study's storage of `url`, its schema version committed (SQLAlchemy 2 rolls optuna 2's back)."""
    for name in ("alembic", "alembic.runtime.plugins"):  # its migrations' INFO lines: quiet here
        logging.getLogger(name).setLevel(logging.WARNING)
    # its alembic head, committed where the store lacks it: RDBStorage then finds it and stamps nothing
    here = Path(rdb.__file__).parent
    config = alembic.config.Config(str(here / "alembic.ini"))
    config.set_main_option("script_location", rdb.escape_alembic_config_value(f"{here}/alembic"))
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as connection:
            context = alembic.migration.MigrationContext.configure(connection)
            if context.get_current_revision() is None:
                context.stamp(alembic.script.ScriptDirectory.from_config(config), "head")
    finally:
        engine.dispose()
    return _CachedStorage(RDBStorage(url))
