"""``gpipe view``: an offline page that plays micro-batches through the stages, as gpipe's own
schedules and simulator say (mirrored in JavaScript, held to the Python by a test), beside a
measured step where there is one."""

from gpipe.view.page import (
    DEFAULT_COSTS,
    LIMITS,
    Measured,
    Settings,
    asset_path,
    check_settings,
    page_data,
    render,
    write,
)

__all__ = [
    "DEFAULT_COSTS",
    "LIMITS",
    "Measured",
    "Settings",
    "asset_path",
    "check_settings",
    "page_data",
    "render",
    "write",
]
