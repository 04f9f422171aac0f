"""Engine core, model runner and the Triton Python-backend glue."""
