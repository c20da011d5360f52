"""Dependencies the routes declare: the collector's parts, read from ``app.state``.

:func:`trainvitals.monitor.app.create_app` puts them there; a route asks for one
by annotating a parameter, e.g. ``store: StoreDep``. The getters are ``async``
so FastAPI calls them on the event loop rather than through its thread pool.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from trainvitals.alerts import AlertService
from trainvitals.monitor.exposition import ReportCounter, StoreCollector
from trainvitals.monitor.run_settings import RunSettingsTable
from trainvitals.monitor.settings import Settings
from trainvitals.monitor.store import SeriesStore

__all__ = ["AlertsDep", "ExporterDep", "ReportsDep", "RunSettingsDep", "SettingsDep", "StoreDep"]


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> SeriesStore:
    return request.app.state.store


async def get_exporter(request: Request) -> StoreCollector:
    return request.app.state.exporter


async def get_reports(request: Request) -> ReportCounter:
    return request.app.state.reports


async def get_alerts(request: Request) -> AlertService:
    return request.app.state.alerts


async def get_run_settings(request: Request) -> RunSettingsTable:
    return request.app.state.run_settings


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[SeriesStore, Depends(get_store)]
ExporterDep = Annotated[StoreCollector, Depends(get_exporter)]
ReportsDep = Annotated[ReportCounter, Depends(get_reports)]
AlertsDep = Annotated[AlertService, Depends(get_alerts)]
RunSettingsDep = Annotated[RunSettingsTable, Depends(get_run_settings)]
