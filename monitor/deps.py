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
    part: Settings = request.app.state.settings
    return part


async def get_store(request: Request) -> SeriesStore:
    part: SeriesStore = request.app.state.store
    return part


async def get_exporter(request: Request) -> StoreCollector:
    part: StoreCollector = request.app.state.exporter
    return part


async def get_reports(request: Request) -> ReportCounter:
    part: ReportCounter = request.app.state.reports
    return part


async def get_alerts(request: Request) -> AlertService:
    part: AlertService = request.app.state.alerts
    return part


async def get_run_settings(request: Request) -> RunSettingsTable:
    part: RunSettingsTable = request.app.state.run_settings
    return part


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[SeriesStore, Depends(get_store)]
ExporterDep = Annotated[StoreCollector, Depends(get_exporter)]
ReportsDep = Annotated[ReportCounter, Depends(get_reports)]
AlertsDep = Annotated[AlertService, Depends(get_alerts)]
RunSettingsDep = Annotated[RunSettingsTable, Depends(get_run_settings)]
