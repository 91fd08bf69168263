"""The validation kit: captures of a run's boundaries compared with a reference implementation's."""
