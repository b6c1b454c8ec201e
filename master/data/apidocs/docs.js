// Swagger UI over this master's own OpenAPI document. A file, not an inline script: the page's
// Content-Security-Policy allows scripts from this origin only (master/api/routes_docs.py).
"use strict";

window.addEventListener("DOMContentLoaded", () => {
  const root = document.getElementById("swagger-ui");
  window.ui = window.SwaggerUIBundle({
    url: root.dataset.specUrl,
    dom_id: "#swagger-ui",
    deepLinking: true,
    // "Try it out" sends the API key typed into Authorize as a Bearer header, to this origin only.
    persistAuthorization: false,
    validatorUrl: null, // never ask validator.swagger.io about our document
    presets: [window.SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});
