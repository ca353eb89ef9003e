// sluice-port-bench's floors (floors.cu): the ping-pong with the proxy's work replaced by the
// bare act of each way a host proxy can carry a put+signal between two GPUs.
#pragma once

// Prints the floors table; 0 on success. `rounds` round trips per measurement, `reps`
// measurements per way, interleaved.
int run_floors(int dev_a, int dev_b, int rounds, int reps);
