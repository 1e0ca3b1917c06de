"""The test clusters' subnets: two live clusters never share one (tests/harness/sshcluster.py)."""

from tests.harness.sshcluster import TAGS, claim_tag


def test_a_claimed_subnet_is_not_claimed_again_until_it_is_freed():
    first, holder = claim_tag()
    try:
        second, other = claim_tag()  # the same process, as a module's own cluster beside the session's
        other.close()
        assert second != first and second in TAGS and first in TAGS
    finally:
        holder.close()
    again, holder = claim_tag()  # freed: the next claim, starting from the same place, gets it back
    holder.close()
    assert again == first
