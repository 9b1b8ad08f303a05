"""kvtui compare's panes: one lane per cache strategy and the step-time plot."""
