"""The site: cluster profiles, discovery, node probes, doctor, binding, calibration."""
