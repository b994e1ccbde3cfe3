"""Outsider checks of issue 27 (the scheduler under load: late binding, echoed link timing, calibration)."""
