from __future__ import annotations

import hashlib

import pytest

from nulltickets.domain.tokens import lease_token_hash, new_lease_token, same_token
from nulltickets.errors import Unauthorized


def test_new_token_is_64_hex_and_its_hash_is_sha256_of_the_raw_bytes() -> None:
    token, digest = new_lease_token()
    assert len(token) == 64 and token == token.lower()
    assert digest == hashlib.sha256(bytes.fromhex(token)).digest()
    assert lease_token_hash(token) == digest
    assert lease_token_hash(token.upper()) == digest  # uppercase hex is accepted


def test_tokens_are_not_repeated() -> None:
    assert len({new_lease_token()[0] for _ in range(100)}) == 100


@pytest.mark.parametrize("bad", ["", "abc", "0" * 63, "0" * 65, "g" * 64, " " + "0" * 63])
def test_anything_but_64_hex_characters_is_unauthorized(bad: str) -> None:
    with pytest.raises(Unauthorized):
        lease_token_hash(bad)


def test_admin_token_comparison_is_exact() -> None:
    assert same_token("secret", "secret")
    assert not same_token("secret ", "secret")
    assert not same_token("", "secret")
