"""Planning: rematerialization solver, pipeline schedules as DAGs and their simulation."""
