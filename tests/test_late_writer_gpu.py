"""The late writer that the tests of reads before a grid wait rely on (late_writer.py)."""
import pytest

from drvtrain import dependent_launches
from late_writer import LATE_NS, CopyCase, copy_around_the_wait, late_copy, skip_unless_a_read_can_race, words

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("early", [1, 0], ids=["read-before-the-wait", "read-after-the-wait"])
def test_a_read_before_the_wait_meets_the_late_writers_poison(device, stream, rng, early):
    """Poisoned x, then `late_copy` writes it and a kernel launched dependent on it copies
    x: where it reads x before its grid wait it gets the poison in every element (the
    test of a settled read can fail), after the wait the values."""
    skip_unless_a_read_can_race(device, early)
    case = CopyCase(rng)
    writer, reader = late_copy(), copy_around_the_wait()
    for _ in range(2):
        case.poison(stream)
        with dependent_launches(True):
            writer.launch(1, 128, case.x, case.source, words(case.x), 0, 0, 0, LATE_NS, stream=stream)
            reader.launch(case.n // 256, 256, case.out, case.x, case.n, early, stream=stream)
        case.check(read_before_the_writer=bool(early))
