"""The OpenAPI rows of the retrieval routes, and the models of their answers."""

from __future__ import annotations

from pydantic import RootModel

from lmserve.server.api.retrieval.protocol import ClassifyRequest, RerankRequest, ScoreRequest, TEIEmbedRequest
from lmserve.server.api.route_doc import GEN_ERRORS, Open, RouteDoc, TGIError


class RerankResult(Open):
    index: int
    relevance_score: float


class RerankAnswer(Open):
    """Jina / Cohere: results best first."""

    model: str
    results: list[RerankResult]


class TEIRank(Open):
    index: int
    score: float


class RerankAnswers(RootModel[RerankAnswer | list[TEIRank]]):
    """/rerank answers Jina's shape, or TEI's list where the body was TEI's (`texts`)."""


class ScoreItem(Open):
    index: int
    score: float


class ScoreAnswer(Open):
    object: str
    model: str
    data: list[ScoreItem]


class ClassifyItem(Open):
    index: int
    label: str
    probs: list[float]


class ClassifyAnswer(Open):
    object: str
    model: str
    data: list[ClassifyItem]


class TEIEmbeddings(RootModel[list[list[float]]]):
    """TEI's /embed: one vector per input."""


ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("post", "/v1/rerank"): RouteDoc(RerankRequest, RerankAnswer, GEN_ERRORS),
    ("post", "/v2/rerank"): RouteDoc(RerankRequest, RerankAnswer, GEN_ERRORS),
    ("post", "/rerank"): RouteDoc(RerankRequest, RerankAnswers, GEN_ERRORS),
    ("post", "/v1/score"): RouteDoc(ScoreRequest, ScoreAnswer, GEN_ERRORS),
    ("post", "/classify"): RouteDoc(ClassifyRequest, ClassifyAnswer, GEN_ERRORS),
    ("post", "/embed"): RouteDoc(TEIEmbedRequest, TEIEmbeddings, GEN_ERRORS),
}
ERROR_MODEL = TGIError  # /embed's errors (TEI's body); the others answer OpenAI's, as the registry picks by path
