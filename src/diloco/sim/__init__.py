"""Goodput at scale: a discrete-event simulator of chip failures (``diloco simulate``).

Modules, one job each: ``defaults`` holds the published targets and fitted values (no
numpy), ``failures`` draws slice outages (vectorized with numpy), ``modes`` turns outages
into goodput and uptime for each training mode (pure accounting), ``grid`` runs the chip-count
× mode grid over seeds, ``calibrate`` holds the fitting objective for the data-parallel rows,
``twin`` predicts a real ``diloco run --chaos`` run, ``plot`` draws the PNG, ``cli`` is the
sub-command.
"""
