// Test only: while held, this process's shm endpoints leave the describe questions of their
// peers unanswered (for at most 60 s), so a test can stall one peer's region description.
#pragma once

namespace sluice::detail::shm {

void hold_test_describes(bool on);
// The serving side's check (describe_local).
void wait_while_test_describes_held();

}  // namespace sluice::detail::shm
