"""One module per provider type, plus the run history store; registered in ``bootstrap``."""
