//! Document bytes for the document tests (docs/documents.md): a minimal PDF whose text is known.

use lopdf::{Document, Object, Stream, dictionary};

/// A one-page PDF whose page shows `text` (Helvetica), built with lopdf.
pub fn tiny_pdf(text: &str) -> Vec<u8> {
    use lopdf::content::{Content, Operation};
    let content = Content {
        operations: vec![
            Operation::new("BT", vec![]),
            Operation::new("Tf", vec!["F1".into(), 12.into()]),
            Operation::new("Td", vec![72.into(), 700.into()]),
            Operation::new("Tj", vec![Object::string_literal(text)]),
            Operation::new("ET", vec![]),
        ],
    };
    one_page(Stream::new(
        dictionary! {},
        content.encode().expect("content encodes"),
    ))
}

/// A PDF bomb (docs/security.md, "PDF extraction"): one page whose Flate-compressed content
/// stream holds `operations` empty text operations (`()Tj`), about 5 bytes each inflated and a
/// few thousand to the kilobyte compressed — 4 million make a 40 KB file. An unbounded
/// extractor decodes every operation at once (hundreds of bytes each) and finds no text.
pub fn pdf_bomb(operations: usize) -> Vec<u8> {
    let mut content = Vec::with_capacity(16 + operations * 5);
    content.extend_from_slice(b"BT /F1 12 Tf\n");
    for _ in 0..operations {
        content.extend_from_slice(b"()Tj\n");
    }
    content.extend_from_slice(b"ET\n");
    let mut stream = Stream::new(dictionary! {}, content);
    stream.compress().expect("content compresses");
    one_page(stream)
}

/// A PDF of one A4 page drawn by `content`, with Helvetica as its font `F1`.
fn one_page(content: Stream) -> Vec<u8> {
    let mut doc = Document::with_version("1.5");
    let pages_id = doc.new_object_id();
    let font_id = doc.add_object(dictionary! {
        "Type" => "Font", "Subtype" => "Type1", "BaseFont" => "Helvetica",
    });
    let resources_id = doc.add_object(dictionary! {
        "Font" => dictionary! { "F1" => font_id },
    });
    let content_id = doc.add_object(content);
    let page_id = doc.add_object(dictionary! {
        "Type" => "Page", "Parent" => pages_id, "Contents" => content_id,
    });
    doc.objects.insert(
        pages_id,
        Object::Dictionary(dictionary! {
            "Type" => "Pages", "Kids" => vec![page_id.into()], "Count" => 1,
            "Resources" => resources_id,
            "MediaBox" => vec![0.into(), 0.into(), 595.into(), 842.into()],
        }),
    );
    let catalog_id = doc.add_object(dictionary! { "Type" => "Catalog", "Pages" => pages_id });
    doc.trailer.set("Root", catalog_id);
    let mut bytes = Vec::new();
    doc.save_to(&mut bytes).expect("pdf saves");
    bytes
}
