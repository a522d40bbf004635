"""What a hostile peer, payload or process can do: unpickle_allow, job keys, exposure, fuzzing."""
