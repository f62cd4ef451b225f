"""Autoscaling benchmark: a compressed replay of the Azure code trace on the local mesh, with
the autoscaler, with a fixed pool sized for the average load and one sized for the peak."""
