"""Tools behind ``cli.py``: ``profile`` / ``plan`` (:mod:`~.cost_cli`) and ``check`` (:mod:`~.mode_check`)."""
