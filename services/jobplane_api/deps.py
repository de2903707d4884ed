"""Dependencies of the routes, as ``Annotated`` aliases. Everything comes from app.state, which
the lifespan fills: nothing is built at import time. They are ``async def`` although they do
no I/O: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop per request
that cost more than the trigger's own database write."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from jobplane.bus.abc import Bus
from jobplane.dispatch import Dispatcher
from jobplane.store.abc import ApiStore
from jobplane_api.settings import ApiSettings


async def get_store(request: Request) -> ApiStore:
    store: ApiStore = request.app.state.store
    return store


async def get_bus(request: Request) -> Bus:
    bus: Bus = request.app.state.bus
    return bus


async def get_dispatcher(request: Request) -> Dispatcher:
    dispatcher: Dispatcher = request.app.state.dispatcher
    return dispatcher


async def get_settings(request: Request) -> ApiSettings:
    settings: ApiSettings = request.app.state.settings
    return settings


StoreDep = Annotated[ApiStore, Depends(get_store)]
BusDep = Annotated[Bus, Depends(get_bus)]
DispatcherDep = Annotated[Dispatcher, Depends(get_dispatcher)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
