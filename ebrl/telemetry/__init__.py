from ebrl.telemetry.logging import configure_logging, get_logger

__all__ = ["configure_logging", "get_logger"]
