"""The endpoint table: its entries' derived values (paths filled in, problem replies)."""

from __future__ import annotations

from contract import endpoints
from contract.endpoints import COMMON_PROBLEMS, ENDPOINTS, GUARDED_PROBLEMS, Endpoint


def test_a_path_is_filled_in_with_each_parameter_encoded_whole() -> None:
    path = endpoints.UNREGISTER.url_path(instance_id="eng/0 x", rank=2)
    assert path == "/register/eng%2F0%20x/2"
    assert endpoints.DELETE_LOOKUP_AREA.url_path(area_id="a?b") == "/cache/lookup-areas/a%3Fb"


def test_problems_add_the_common_and_the_tokens_under_the_entrys_own() -> None:
    entry = Endpoint(
        name="x",
        method="POST",
        path="/x",
        request=None,
        response=None,
        summary="x",
        guarded=True,
        problems={422: "Not like that", 409: "Not now"},
    )
    assert entry.all_problems() == {
        413: COMMON_PROBLEMS[413],
        401: GUARDED_PROBLEMS[401],
        422: "Not like that",
        409: "Not now",
    }
    open_entry = Endpoint(
        name="y", method="GET", path="/y", request=None, response=None, summary=""
    )
    assert open_entry.all_problems() == dict(COMMON_PROBLEMS)


def test_every_mutating_entry_is_guarded_and_every_read_is_open() -> None:
    for entry in ENDPOINTS:
        assert entry.guarded == (entry.method != "GET"), entry.name


def test_slashed_parameters_are_parameters_of_the_path() -> None:
    for entry in ENDPOINTS:
        for name in entry.slashed:
            assert f"{{{name}}}" in entry.path, entry.name
