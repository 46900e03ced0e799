"""The machine model: devices, links, measured profiles, presets, calibration."""
