"""Datacenter-scale chaos simulator (torch-free): goodput and uptime of data-parallel,
elastic data-parallel and Decoupled DiLoCo under per-chip failures."""
