"""Pydantic models for the structured-output tests: the shapes applications ask for (nested
objects, arrays, enums, optional and required fields, bounded numbers, unions, recursion)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, Field


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)
    email: str | None


class Address(BaseModel):
    street: str
    city: str
    postcode: str = Field(pattern=r"^[0-9]{5}$")
    country: Literal["FR", "DE", "US", "JP"]


class Item(BaseModel):
    sku: str
    quantity: int = Field(ge=1, le=99)
    price: float = Field(ge=0)


class Order(BaseModel):
    order_id: int
    items: list[Item] = Field(min_length=1, max_length=3)
    status: Literal["new", "paid", "shipped"]


class Weather(BaseModel):
    city: str
    temperature: float = Field(ge=-50, le=60)
    unit: Literal["celsius", "fahrenheit"]
    conditions: list[str] = Field(max_length=3)


class Event(BaseModel):
    title: str
    attendees: list[str] = Field(min_length=1, max_length=4)
    online: bool


class Genre(str, Enum):
    drama = "drama"
    comedy = "comedy"
    horror = "horror"
    scifi = "sci-fi"


class Movie(BaseModel):
    title: str
    year: int = Field(ge=1900, le=2030)
    genres: list[Genre] = Field(max_length=3)
    rating: float | None = Field(ge=0, le=10)


class Cat(BaseModel):
    kind: Literal["cat"]
    indoor: bool


class Dog(BaseModel):
    kind: Literal["dog"]
    breed: str


class Pet(BaseModel):
    name: str
    animal: Annotated[Cat | Dog, Field(discriminator="kind")]


class Member(BaseModel):
    name: str
    role: Literal["lead", "engineer", "designer"]


class Team(BaseModel):
    team: str = Field(max_length=40)
    lead: Member
    members: list[Member] = Field(max_length=3)


class Author(BaseModel):
    name: str
    born: int | None


class Book(BaseModel):
    title: str
    author: Author
    pages: int = Field(gt=0, lt=5000)
    tags: list[str] = Field(max_length=3)


class Node(BaseModel):
    label: str = Field(max_length=24)
    children: list[Node] = Field(max_length=2)


class Settings(BaseModel):
    debug: bool
    level: Literal[1, 2, 3]
    ratio: float = Field(gt=0, le=1)
    owner: str | None


# model -> what the user asks for
SCHEMAS: dict[type[BaseModel], str] = {
    Person: "Describe a fictional person.",
    Address: "Give the address of a famous museum.",
    Order: "Create an order for two books.",
    Weather: "What is the weather like in Oslo today?",
    Event: "Plan a team meeting.",
    Movie: "Describe a classic film.",
    Pet: "Tell me about a pet.",
    Team: "Describe a small software team.",
    Book: "Describe a novel you like.",
    Node: "A tree: the root 'A' has two leaves, 'B' and 'C'.",
    Settings: "Give the settings for a logging system.",
}
